"""Student model: conversion for every family, HF save/load round trips, remote code, cache forms."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers Auto classes)
from attn2ssm.student.convert import convert
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from attn2ssm.student.plans import interleaved_keep, make_plan
from cache_forms import full_and_pieces, greedy_by_full_forwards, run_remote
from tiny_models import TINY_CONFIGS, tiny_model

FAMILIES = sorted(TINY_CONFIGS)
LA = "linear_attention"


def _ids(b=2, l=12, vocab=256, seed=0):
    return torch.randint(0, vocab, (b, l), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def teachers():
    return {f: tiny_model(f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_converts_runs_saves_and_reloads(family, teachers, tmp_path):
    teacher = teachers[family]
    n = teacher.config.num_hidden_layers
    for plan in ([LA] * n, make_plan(n, LA, attention_ratio=0.5)):
        student = convert(teacher, plan)
        ids = _ids()
        logits = student(input_ids=ids, use_cache=False).logits
        assert logits.shape == (2, 12, teacher.config.vocab_size) and torch.isfinite(logits).all()
        student.save_pretrained(tmp_path / "s")
        assert (tmp_path / "s" / "model.safetensors").exists()
        cfg = json.loads((tmp_path / "s" / "config.json").read_text())
        assert cfg["model_type"] == "attn2ssm" and cfg["layer_plan"] == plan and "auto_map" in cfg
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "s")
        assert isinstance(loaded, Attn2SSMForCausalLM)
        torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, logits, atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_all_attention_plan_is_the_teacher(family, teachers):
    teacher = teachers[family]
    student = convert(teacher, ["attention"] * teacher.config.num_hidden_layers)
    ids = _ids()
    torch.testing.assert_close(
        student(input_ids=ids, use_cache=False).logits,
        teacher(input_ids=ids, use_cache=False).logits,
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_mixer_starts_from_teacher_projections(family, teachers):
    """Swapping in a linear mixer changes only attention: the first layer's q/k/v/o equal the teacher's."""
    from attn2ssm.adapters import get_adapter

    teacher = teachers[family]
    student = convert(teacher, [LA] * teacher.config.num_hidden_layers)
    adapter = get_adapter(teacher)
    w = adapter.read_weights(teacher.get_submodule(adapter.attention_module_paths(teacher)[0]))
    mixer = student.mixers()[0]
    for mine, theirs in (
        (mixer.q_proj.weight, w.q),
        (mixer.k_proj.weight, w.k),
        (mixer.v_proj.weight, w.v),
        (mixer.o_proj.weight, w.o),
    ):
        assert torch.equal(mine, theirs)
    # everything that is not attention is shared with the teacher bit for bit
    t_state = teacher.state_dict()
    for name, value in student.base.state_dict().items():
        if not any(name.startswith(p + ".") for p in student.config.attention_paths):
            assert torch.equal(value, t_state[name]), name


def test_plans():
    assert interleaved_keep(30, 0.5) == list(range(0, 30, 2))
    assert len(interleaved_keep(30, 0.25)) == 8 and interleaved_keep(30, 0.0) == []
    assert make_plan(4, LA, keep_attention=[1]) == [LA, "attention", LA, LA]
    from attn2ssm.errors import ConfigError

    with pytest.raises(ConfigError, match="outside"):
        make_plan(4, LA, keep_attention=[7])
    with pytest.raises(ConfigError, match="unknown mixer"):
        make_plan(4, "nope")


# --------------------------------------------------------------------------------------------
# cache: full forward == chunked prefill == prefill + token-by-token decode (fp32, with padding)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "gpt_neox", "phi"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_prefill_chunked_and_decode_agree(family, ratio, teachers):
    teacher = teachers[family]
    n = teacher.config.num_hidden_layers
    student = convert(teacher, make_plan(n, LA, attention_ratio=ratio))
    ids = _ids(l=14)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    real = mask.bool()
    full, stepped = full_and_pieces(student, ids, mask, [6] + [1] * 8)
    torch.testing.assert_close(stepped[real], full[real], atol=1e-4, rtol=1e-4)
    full, chunked = full_and_pieces(student, ids, mask, [5, 3, 6])
    torch.testing.assert_close(chunked[real], full[real], atol=1e-4, rtol=1e-4)


def test_cache_state_is_constant_in_length(teachers):
    teacher = teachers["llama"]
    student = convert(teacher, [LA] * teacher.config.num_hidden_layers)
    sizes = []
    for length in (8, 64):
        cache = student.new_cache()
        student(input_ids=_ids(l=length), past_key_values=cache, use_cache=True)
        sizes.append(sum(layer.state_bytes() for layer in cache.layers))
        assert cache.get_seq_length() == length
    assert sizes[0] == sizes[1] > 0


def test_greedy_generate_equals_repeated_full_forward(teachers):
    teacher = teachers["llama"]
    student = convert(teacher, make_plan(teacher.config.num_hidden_layers, LA, attention_ratio=0.5))
    ids = _ids(b=1, l=5)
    out = student.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(student, ids, 6))


# --------------------------------------------------------------------------------------------
# remote code: a process that cannot import attn2ssm loads and runs a saved student

REMOTE = r"""
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
ids = torch.load(d + "/ids.pt")
logits = m(input_ids=ids, use_cache=False).logits
gen = m.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
print(json.dumps({"max_diff": (logits - torch.load(d + "/logits.pt")).abs().max().item(), "gen": gen.tolist(), "cls": type(m).__module__}))
"""


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_loads_with_trust_remote_code_without_attn2ssm(family, teachers, tmp_path):
    teacher = teachers[family]
    student = convert(teacher, make_plan(teacher.config.num_hidden_layers, LA, attention_ratio=0.5))
    ids = _ids()
    student.save_pretrained(tmp_path)
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(student(input_ids=ids, use_cache=False).logits, tmp_path / "logits.pt")
    result = run_remote(REMOTE, tmp_path)
    assert result["max_diff"] == 0.0
    assert result["cls"].startswith("transformers_modules")
    assert len(result["gen"][0]) == 8


def test_unknown_mixer_option_is_a_config_error(teachers):
    from attn2ssm.errors import ConfigError

    teacher = teachers["llama"]
    with pytest.raises(ConfigError, match="valid options: .*feature_map"):
        convert(teacher, [LA] * teacher.config.num_hidden_layers, {LA: {"feature_mpa": "elu"}})
    with pytest.raises(ConfigError, match="rope"):
        convert(teacher, [LA] * teacher.config.num_hidden_layers, {LA: {"rope": "after"}})


@pytest.mark.parametrize(
    "feature_map", ["elu", "relu", "hedgehog", "t2r", "taylor", "performer", "cosformer", "exp_t"]
)
def test_every_feature_map_prefill_chunked_and_decode_agree(feature_map, teachers):
    """Recurrent state is exact for every map, position-aware ones (cosFormer) included."""
    teacher = teachers["llama"]
    student = convert(teacher, [LA] * teacher.config.num_hidden_layers, {LA: {"feature_map": feature_map}})
    ids = _ids(l=12)
    mask = torch.ones(2, 12, dtype=torch.long)
    full, stepped = full_and_pieces(student, ids, mask, [5] + [1] * 7)
    torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)
    full, chunked = full_and_pieces(student, ids, mask, [4, 3, 5])
    torch.testing.assert_close(chunked, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_sliding_window_mixer_prefill_chunked_and_decode_agree(ratio, teachers):
    teacher = teachers["llama"]
    plan = make_plan(teacher.config.num_hidden_layers, LA, attention_ratio=ratio)
    student = convert(teacher, plan, {LA: {"feature_map": "hedgehog", "window": 4, "chunk_size": 3}})
    ids = _ids(l=14)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0
    real = mask.bool()
    full, stepped = full_and_pieces(student, ids, mask, [6] + [1] * 8)
    torch.testing.assert_close(stepped[real], full[real], atol=1e-4, rtol=1e-4)
    full, chunked = full_and_pieces(student, ids, mask, [5, 3, 6])
    torch.testing.assert_close(chunked[real], full[real], atol=1e-4, rtol=1e-4)
    # the quadratic path used by attention transfer gives the same layer output
    mixer = next(iter(student.mixers().values()))
    x = torch.randn(2, 14, teacher.config.hidden_size)
    pe = teacher.model.rotary_emb(x, torch.arange(14)[None].expand(2, -1))
    out_q, weights = mixer.forward_quadratic(x, pe)
    out_f, _ = mixer(x, position_embeddings=pe)
    torch.testing.assert_close(out_q, out_f, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 14), atol=1e-5, rtol=0)


def test_window_factor_trains_with_feature_maps(teachers):
    from attn2ssm.distill.stages import select_trainable

    teacher = teachers["llama"]
    student = convert(teacher, [LA, LA], {LA: {"feature_map": "hedgehog", "window": 4}})
    names = select_trainable(student, ["feature_maps"])
    assert any(n.endswith("window_factor") for n in names) and any(".feature_map_q." in n for n in names)
