"""Layer plans: placements, stepwise nesting, and growing a student (teacher-measured selection: tests/distill/test_layer_selection.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers Auto classes)
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.registry import MIXERS
from attn2ssm.student.convert import convert, converted_layer, grow_student
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from attn2ssm.student.plans import clustered_keep, interleaved_keep, make_plan, nested_keep
from tiny_models import tiny_model

LA = "linear_attention"
HH = {LA: {"feature_map": "hedgehog"}}
A = "attention"


def _llama(layers=4, seed=0):
    return tiny_model("llama", seed, layers)


def _ids(b=2, l=12, seed=0):
    return torch.randint(0, 256, (b, l), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def teacher():
    return _llama()


# --------------------------------------------------------------------------------------------
# placements


def test_interleaved_first_is_unchanged_and_last_matches_paper_004():
    assert interleaved_keep(30, 0.5) == interleaved_keep(30, 0.5, "first") == list(range(0, 30, 2))
    assert interleaved_keep(30, 0.25) == [0, 3, 7, 11, 15, 18, 22, 26]
    assert interleaved_keep(30, 0.125) == [0, 7, 15, 22]
    assert interleaved_keep(32, 0.5, "last") == list(range(1, 32, 2))
    assert interleaved_keep(32, 0.25, "last") == list(range(3, 32, 4))
    assert interleaved_keep(32, 0.125, "last") == [7, 15, 23, 31]
    assert interleaved_keep(30, 0.5, "last") == list(range(1, 30, 2))
    assert interleaved_keep(30, 0.25, "last") == [2, 6, 10, 14, 17, 21, 25, 29]
    for align in ("first", "last"):
        assert interleaved_keep(30, 0.0, align) == [] and interleaved_keep(7, 1.0, align) == list(range(7))
    with pytest.raises(ConfigError, match="align"):
        interleaved_keep(8, 0.5, "middle")


def test_clustered():
    assert clustered_keep(30, 0.25) == list(range(22, 30))
    assert clustered_keep(30, 0.25, "first") == list(range(8))
    assert clustered_keep(30, 0.25, "middle") == list(range(11, 19))
    assert clustered_keep(8, 0.0, "middle") == []
    with pytest.raises(ConfigError, match="where"):
        clustered_keep(8, 0.5, "top")
    with pytest.raises(ConfigError, match="outside"):
        clustered_keep(8, 1.5)


def test_make_plan_placement_and_align():
    assert make_plan(4, LA, attention_ratio=0.5) == [A, LA, A, LA]
    assert make_plan(4, LA, attention_ratio=0.5, align="last") == [LA, A, LA, A]
    assert make_plan(4, LA, attention_ratio=0.5, placement="clustered") == [LA, LA, A, A]
    assert make_plan(4, LA, attention_ratio=0.5, placement="clustered", where="first") == [A, A, LA, LA]
    assert make_plan(4, LA, attention_ratio=0.5, placement="clustered", keep_attention=[1]) == [LA, A, LA, LA]
    with pytest.raises(ConfigError, match="placement"):
        make_plan(4, LA, placement="random")
    with pytest.raises(ConfigError, match="auto_plan"):
        make_plan(4, LA, keep_attention="auto")


def test_nested_keep_is_nested_and_matches_paper_on_32_layers():
    assert nested_keep(32, [0.5, 0.25, 0.125], "last") == [
        list(range(1, 32, 2)),
        list(range(3, 32, 4)),
        [7, 15, 23, 31],
    ]
    assert nested_keep(32, [0.5, 0.25], "first") == [interleaved_keep(32, 0.5), interleaved_keep(32, 0.25)]
    for align in ("first", "last"):
        stages = nested_keep(30, [0.5, 0.25, 0.125, 0.0], align)
        assert [len(s) for s in stages] == [15, 8, 4, 0]
        for before, after in zip(stages, stages[1:]):
            assert set(after) <= set(before)
    assert nested_keep(30, [0.5, 0.25], "last")[1] == [1, 5, 9, 13, 17, 21, 25, 29]
    assert not set(interleaved_keep(30, 0.25)) <= set(interleaved_keep(30, 0.5))  # why nested_keep exists
    with pytest.raises(ConfigError, match="largest to smallest"):
        nested_keep(8, [0.25, 0.5])


def test_converted_layer_restores_the_student(teacher):
    probe = convert(teacher, [A] * 4)
    attn = probe.base.model.layers[2].self_attn
    ids = _ids()
    with torch.no_grad():
        base_logits = probe(input_ids=ids, use_cache=False).logits
        with converted_layer(probe, 2, LA, {"feature_map": "hedgehog"}) as mixer:
            assert probe.config.layer_plan == [A, A, LA, A] and probe.mixers() == {2: mixer}
            swapped = probe(input_ids=ids, use_cache=False).logits
        assert probe.base.model.layers[2].self_attn is attn and probe.config.layer_plan == [A] * 4
        assert probe.config.mixer_options == {}
        torch.testing.assert_close(probe(input_ids=ids, use_cache=False).logits, base_logits, atol=0, rtol=0)
    one = convert(teacher, [A, A, LA, A], HH)
    torch.testing.assert_close(swapped, one(input_ids=ids, use_cache=False).logits, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# grow_student


def _trained_student(teacher, plan):
    """A converted student whose mixers, MLPs and kept attention have 'trained' away from the teacher."""
    student = convert(teacher, plan, HH)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if ".mlp." in name or ".self_attn." in name or "norm" in name:
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    return student


def test_grow_carries_trained_weights_and_inits_new_layers_from_teacher(teacher, tmp_path):
    old_keep, new_keep = nested_keep(4, [0.5, 0.25])
    old_plan, new_plan = make_plan(4, LA, keep_attention=old_keep), make_plan(4, LA, keep_attention=new_keep)
    assert old_plan == [A, LA, A, LA] and new_plan == [A, LA, LA, LA]
    student = _trained_student(teacher, old_plan)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    grown = grow_student(student, teacher, new_plan)
    assert isinstance(grown, Attn2SSMForCausalLM) and grown.config.layer_plan == new_plan
    assert student.config.layer_plan == old_plan and all(
        torch.equal(v, student.state_dict()[k]) for k, v in before.items()
    )
    assert grown.config.mixer_options == HH and not grown.training

    new_prefix = "base.model.layers.2.self_attn."
    old_state, new_state = student.state_dict(), grown.state_dict()
    carried = [k for k in new_state if not k.startswith(new_prefix)]
    assert any(".mlp." in k for k in carried) and any(
        "layers.1.self_attn.feature_map_q" in k for k in carried
    )
    for k in carried:
        assert torch.equal(new_state[k], old_state[k]), k
    fresh = convert(teacher, new_plan, HH).state_dict()
    new_keys = [k for k in new_state if k.startswith(new_prefix)]
    assert any(k.endswith("q_proj.weight") for k in new_keys) and any("feature_map" in k for k in new_keys)
    for k in new_keys:
        assert torch.equal(new_state[k], fresh[k]), k
    assert not torch.equal(new_state[new_prefix + "q_proj.weight"], old_state[new_prefix + "q_proj.weight"])

    ids = _ids()
    logits = grown(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(logits).all()
    grown.save_pretrained(tmp_path / "g")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "g")
    assert isinstance(loaded, Attn2SSMForCausalLM) and loaded.config.layer_plan == new_plan
    torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, logits, atol=0, rtol=0)
    # and the grown student decodes with its hybrid cache
    out = grown.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def test_grow_rejects_plans_that_are_not_growth(teacher):
    student = convert(teacher, [A, LA, A, LA], HH)
    with pytest.raises(ConfigError, match="back into attention"):
        grow_student(student, teacher, [A, A, LA, LA])
    with pytest.raises(ConfigError, match="entries"):
        grow_student(student, teacher, [A, LA, LA])
    with pytest.raises(ConfigError, match="unknown mixer"):
        grow_student(student, teacher, [A, LA, "nope", LA])
    with pytest.raises(ConfigError, match="options"):
        grow_student(student, teacher, [LA] * 4, {LA: {"feature_map": "elu"}})
    with pytest.raises(ConfigError, match="does not match"):
        grow_student(student, _llama(layers=2), [LA] * 4)

    # a different mixer kind for a trained layer (a registered stand-in, so this does not depend on other mixers)
    class Other(MIXERS[LA]):
        mixer_type = "other"

    MIXERS["other_test_mixer"] = Other
    try:
        with pytest.raises(ConfigError, match="changes layer 1"):
            grow_student(student, teacher, [A, "other_test_mixer", A, LA])
    finally:
        del MIXERS["other_test_mixer"]
    assert grow_student(
        student, teacher, [A, LA, A, LA], {LA: {"feature_map": "hedgehog"}}
    ).config.layer_plan == [A, LA, A, LA]


def test_grow_keeps_dtype_and_device():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = _llama().to(device=device, dtype=torch.bfloat16)
    student = convert(bf16, [A, LA, A, LA], HH)
    grown = grow_student(student, bf16, [LA, LA, A, LA])
    assert {p.dtype for p in grown.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in grown.parameters()} == {torch.device(device).type}
    assert torch.equal(
        grown.base.model.layers[0].self_attn.q_proj.weight, bf16.model.layers[0].self_attn.q_proj.weight
    )
    assert torch.isfinite(grown(input_ids=_ids().to(device), use_cache=False).logits.float()).all()
    # a mixed-precision student (an fp32 feature map in a bf16 model) keeps each tensor's dtype
    fmap = student.base.model.layers[1].self_attn.feature_map_q
    fmap.weight.data = fmap.weight.data.float()
    grown = grow_student(student, bf16, [LA, LA, A, LA])
    dtypes = {n: p.dtype for n, p in grown.named_parameters()}
    assert dtypes.pop("base.model.layers.1.self_attn.feature_map_q.weight") == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}
    assert torch.equal(grown.base.model.layers[1].self_attn.feature_map_q.weight, fmap.weight)


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_every_mixer_kind_grows(kind, teacher):
    """Mamba-family mixers too: carried tensors exact, grown model runs (scoring: tests/distill/test_layer_selection.py)."""
    student = convert(teacher, [A, kind, A, kind])
    grown = grow_student(student, teacher, [A, kind, kind, kind])
    old = student.state_dict()
    for k, v in grown.state_dict().items():
        if "layers.2.self_attn." not in k:
            assert torch.equal(v, old[k]), k
    assert torch.isfinite(grown(input_ids=_ids(), use_cache=False).logits).all()
