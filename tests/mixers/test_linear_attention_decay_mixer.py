"""A linear-attention student with a learned per-head decay (``decay: true``): decode equals prefill
(plain and window students, left and middle padding, HF's forward and the CPU decode plan), the
decay reaches every path, it is off by default (old students unchanged), its options are typed,
and a saved decay student generates through remote code without attn2ssm (its compiled decode step
gives the eager tokens: tests/decode/test_compiled.py)."""

import pytest
import torch

from attn2ssm.decode.layout import cpu_decode_layout
from attn2ssm.decode.plan import DecodePlan
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.registry import check_mixer_options
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from cache_forms import full_and_pieces, padded_batch, run_remote
from tiny_models import tiny_model, tiny_student

DECAYED = [
    {"decay": True, "decay_horizon": 6.0},
    {"decay": True, "decay_horizon": 6.0, "feature_map": "hedgehog"},
    {"decay": True, "decay_horizon": 6.0, "window": 3},
]


PIECES = [5] + [1] * 7  # a prefill of 5, then 7 tokens one at a time


@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("options", DECAYED)
def test_decay_student_decodes_as_it_prefills(options, layout, monkeypatch):
    model = tiny_student("gqa_9x3", "linear_attention", options=options)
    plan_calls = []
    if layout:  # the CPU decode layout: fused step, the decode plan
        cpu_decode_layout(model)
        original = DecodePlan.__call__
        monkeypatch.setattr(
            DecodePlan, "__call__", lambda self, *a: plan_calls.append(1) or original(self, *a)
        )
    ids, mask = padded_batch(12, gap=7)
    real = mask.bool()
    with torch.no_grad():
        full, stepped = full_and_pieces(model, ids, mask, PIECES)
    torch.testing.assert_close(stepped[real], full[real], rtol=1e-4, atol=1e-4)
    assert bool(plan_calls) == layout  # the decode plan ran the steps
    # a left-padded row is the unpadded row (weights depend on i − j only)
    with torch.no_grad():
        alone = model(input_ids=ids[1:, 2:7], use_cache=False).logits
    torch.testing.assert_close(full[1, 2:7], alone[0], rtol=1e-4, atol=1e-4)
    # the decay reaches prefill and decode: a much slower decay changes both
    for mixer in model.mixers().values():
        with torch.no_grad():
            mixer.decay_log_rate.fill_(-20.0)
    with torch.no_grad():
        slow, slow_stepped = full_and_pieces(model, ids, mask, PIECES)
    assert (slow[real] - full[real]).abs().max() > 1e-3
    torch.testing.assert_close(slow_stepped[real], slow[real], rtol=1e-4, atol=1e-4)


def test_decay_is_off_by_default_and_starts_near_the_undecayed_student():
    plain = tiny_student("gqa_9x3", "linear_attention", options={"window": 3})
    assert not any("decay" in name for name, _ in plain.named_parameters())  # old checkpoints load unchanged
    torch.manual_seed(0)
    teacher = tiny_model("gqa_9x3")
    plan = make_plan(teacher.config.num_hidden_layers, "linear_attention")
    base = convert(teacher, plan, {"linear_attention": {}}).eval()
    decayed = convert(teacher, plan, {"linear_attention": {"decay": True}}).eval()
    mixer = next(iter(decayed.mixers().values()))
    torch.testing.assert_close(
        torch.exp(mixer.log_decay()),
        torch.full((mixer.num_heads,), float(torch.exp(torch.tensor(-1 / 4096)))),
    )
    ids = torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = base(input_ids=ids).logits, decayed(input_ids=ids).logits
    assert 0 < (a - b).norm() < 1e-2 * a.norm()  # λ^31 ≈ 0.992: a small change at 32 tokens


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"decay": "abc"}, "option decay='abc' is not true or false"),
        ({"decay_horizon": 0}, "option decay_horizon=0 is not a positive number"),
        ({"decay_horizon": "abc"}, "option decay_horizon='abc' is not a positive number"),
    ],
)
def test_decay_options_are_typed(options, needle):
    with pytest.raises(ConfigError) as err:
        check_mixer_options("linear_attention", options)
    assert needle in str(err.value) and "\n" not in str(err.value)


REMOTE = r"""
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
batch, mask = torch.load(d + "/batch.pt")
greedy = m.generate(input_ids=batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
rates = [p.tolist() for n, p in m.named_parameters() if n.endswith("decay_log_rate")]
print(json.dumps({"greedy": greedy.tolist(), "rates": rates, "cls": type(m).__module__}))
"""


def test_a_decay_student_saves_and_generates_through_remote_code(tmp_path):
    torch.manual_seed(0)
    teacher = tiny_model("llama")
    n = teacher.config.num_hidden_layers
    options = {"linear_attention": {"decay": True, "decay_horizon": 6.0, "window": 2}}
    student = convert(teacher, make_plan(n, "linear_attention", attention_ratio=0.5), options).eval()
    for mixer in student.mixers().values():
        with torch.no_grad():
            mixer.decay_log_rate.add_(torch.linspace(-1, 1, mixer.num_heads))
    student.save_pretrained(tmp_path)
    batch = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    batch[1, :3], mask[1, :3] = 0, 0
    torch.save((batch, mask), tmp_path / "batch.pt")
    expected = student.generate(
        input_ids=batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
    )
    # assisted decoding rolls the decayed states back (the cache replays the mixer from a snapshot)
    draft = convert(teacher, make_plan(n, "linear_attention"), options).eval()
    assisted = student.generate(
        input_ids=batch[:1], max_new_tokens=6, do_sample=False, pad_token_id=0, assistant_model=draft
    )
    assert assisted.tolist() == expected[:1].tolist()
    result = run_remote(REMOTE, tmp_path)
    assert result["cls"].startswith("transformers_modules")
    assert result["greedy"] == expected.tolist()
    rates = [p.tolist() for name, p in student.named_parameters() if name.endswith("decay_log_rate")]
    assert rates and result["rates"] == rates


def test_the_decay_trains_with_the_feature_maps():
    """``trainable: [feature_maps]`` (LoLCATs' and Hedgehog's first stage) trains the decay, as it
    trains the window's γ; ``mixers`` includes it too."""
    from attn2ssm.distill.stages import select_trainable

    student = tiny_student("gqa_9x3", "linear_attention", options={"decay": True, "window": 2})
    names = select_trainable(student, ["feature_maps"])
    decays = [n for n, _ in student.named_parameters() if n.endswith(".decay_log_rate")]
    assert decays and set(decays) <= set(names)
    assert set(decays) <= set(select_trainable(student, ["mixers"]))


# ---------------------------------------------------------------------------------------------
# random windows in training (window_train_min)


def test_random_training_windows_draw_from_the_range_and_evaluation_keeps_the_window():
    """window=5, window_train_min=2: each training forward of a layer runs some window in [2, 5]
    (several of them over draws; each layer draws its own — here only the first one draws); in eval
    mode it is the window-5 student."""
    import copy

    options = {"window": 5, "window_train_min": 2, "decay": True, "decay_horizon": 8.0}
    model = tiny_student("gqa_9x3", "linear_attention", options=options)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        evaluated = model(input_ids=ids).logits
    first, *others = model.mixers().values()
    for mixer in others:
        mixer.window_train_min = 0
    want = {}
    for w in range(2, 6):
        fixed = copy.deepcopy(model)
        mixer = next(iter(fixed.mixers().values()))
        mixer.window, mixer.window_train_min = w, 0
        with torch.no_grad():
            want[w] = fixed.train()(input_ids=ids).logits
    torch.testing.assert_close(evaluated, want[5], rtol=0, atol=0)
    model.train()
    seen = set()
    with torch.no_grad():
        for seed in range(12):
            torch.manual_seed(seed)
            got = model(input_ids=ids).logits
            matches = [w for w, logits in want.items() if torch.equal(got, logits)]
            assert len(matches) == 1, matches
            seen.add(matches[0])
    assert len(seen) >= 3, seen


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"window": 4, "window_train_min": 5}, "window_train_min=5 is not in [1, window=4]"),
        ({"window_train_min": 2}, "window_train_min=2 is not in [1, window=0]"),
        ({"window": 4, "window_train_min": -1}, "option window_train_min=-1 is not an integer >= 0"),
    ],
)
def test_window_train_min_out_of_range_is_one_line(options, needle):
    from attn2ssm.mixers.registry import build_mixer

    geometry = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16}
    with pytest.raises(ConfigError) as err:
        build_mixer("linear_attention", geometry, 0, options)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
