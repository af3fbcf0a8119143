"""Weights at fewer bytes (decode/quantize.py): bfloat16 and int8 weight-only forms of the teacher
and its students stay close to float32, prefill and one-token decode agree within each form
(with the CPU decode layout on, as ``generate`` runs them), the benchmark's decode rounds choose
the tokens a plain ``generate`` chooses, and bad flags are one-line errors."""

import copy

import pytest
import torch

from attn2ssm.bench.generate import build_models, measure_decode_interleaved, parse_format
from attn2ssm.decode.layout import cpu_decode_layout
from attn2ssm.decode.quantize import (
    Int8Linear,
    apply_weight_format,
    check_weight_format,
    format_name,
    step_weight_bytes,
)
from attn2ssm.errors import ConfigError
from attn2ssm.hf_compat import CACHE_KWARG
from tiny_models import one_line_error, tiny_model

FORMATS = ["bfloat16", "int8", "bfloat16+int8"]
# Largest |logit difference| against float32 over the largest |float32 logit|, one token after a
# 24-token prompt of the tiny models (weights at std 0.2, so every rounding shows): measured
# 0.008-0.017 for bfloat16, 0.017-0.028 for int8 and 0.019-0.026 for both (teacher, mamba2, hybrid25)
TO_FLOAT32 = {"bfloat16": 0.04, "int8": 0.06, "bfloat16+int8": 0.06}
# Prefill (one forward over the prompt) vs token-by-token decode within one form: the same weights,
# only float rounding of a different op order; bfloat16 activations round to 8 bits at every op
PREFILL_VS_DECODE = {"float32": 1e-4, "bfloat16": 0.03, "int8": 1e-4, "bfloat16+int8": 0.03}


def _ids(n=24, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return build_models(
        tiny_model("llama"), ["teacher", "mamba2", "hybrid25"], torch.device("cpu"), ("float32", *FORMATS)
    )


def test_bfloat16_keeps_the_ssm_parameters_and_buffers_float32(models):
    student = models["mamba2@bfloat16"]
    params = dict(student.named_parameters())
    kept = [n for n in params if n.rsplit(".", 1)[-1] in ("A_log", "D", "dt_bias")]
    assert kept and all(params[n].dtype == torch.float32 for n in kept), kept
    others = [n for n in params if n not in kept]
    assert others and all(params[n].dtype == torch.bfloat16 for n in others)
    assert all(b.dtype == torch.float32 for n, b in student.named_buffers() if b.is_floating_point()), (
        "RoPE's inv_freq must stay float32"
    )


def test_int8_swaps_every_linear_and_counts_a_quarter_of_the_bytes(models):
    fp32, q = models["teacher"], models["teacher@int8"]
    linears = [m for m in fp32.modules() if isinstance(m, torch.nn.Linear)]
    swapped = [m for m in q.modules() if isinstance(m, Int8Linear)]
    assert len(swapped) == len(linears) == q.weight_format["int8_linears"] and not any(
        isinstance(m, torch.nn.Linear) for m in q.modules()
    )
    # the lm_head too
    assert swapped[-1].qweight.dtype == torch.int8 and swapped[-1].out_features == fp32.config.vocab_size
    linear_bytes = sum(m.weight.numel() for m in linears)
    assert step_weight_bytes(fp32) - step_weight_bytes(q) == pytest.approx(3 * linear_bytes, rel=0.02)
    assert q.model.embed_tokens.weight.dtype == torch.float32  # a step reads one row of it


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["teacher", "mamba2", "hybrid25"])
def test_one_token_logits_close_to_float32(models, name, fmt):
    ids = _ids()
    with torch.no_grad():
        ref = models[name](ids).logits[0, -1].float()
        out = models[f"{name}@{fmt}"](ids).logits[0, -1].float()
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert 1e-4 < rel < TO_FLOAT32[fmt], rel  # quantised (not a float32 copy), and close


@pytest.mark.parametrize("fmt", ["float32", *FORMATS])
@pytest.mark.parametrize("name", ["teacher", "mamba2", "hybrid25"])
def test_prefill_and_decode_agree_in_each_format(models, name, fmt):
    """Logits of one forward over 24 tokens = those of a 20-token prefill then 4 one-token steps,
    in CPU decode mode (the pure student's decode plan, fused projections where they still apply)."""
    model = copy.deepcopy(models[name if fmt == "float32" else f"{name}@{fmt}"])
    cpu_decode_layout(model)
    ids = _ids()
    with torch.no_grad():
        full = model(ids).logits[0, -4:].float()
        cache = model(ids[:, :20], use_cache=True).past_key_values
        steps = []
        for t in range(20, 24):
            out = model(ids[:, t : t + 1], use_cache=True, **{CACHE_KWARG: cache})
            cache = out.past_key_values
            steps.append(out.logits[0, -1].float())
    rel = ((torch.stack(steps) - full).abs().max() / full.abs().max()).item()
    assert rel < PREFILL_VS_DECODE[fmt], rel


def test_benchmark_rounds_choose_the_tokens_plain_generate_chooses(models):
    """bench generate's decode path (a prefilled cache copied each round, the CPU decode layout)
    and a user's plain ``generate`` pick the same greedy tokens in every format, and the row
    records the plain call's rate beside the benchmark's."""
    chosen = {n: copy.deepcopy(m) for n, m in models.items() if n.partition("@")[0] in ("teacher", "mamba2")}
    for m in chosen.values():
        cpu_decode_layout(m)
    rows = measure_decode_interleaved(chosen, _ids(20), new_tokens=5, rounds=2, plain_check=True)
    for name, row in rows.items():
        assert row["plain_generate_same_tokens"] and row["same_tokens_every_round"], name
        assert row["plain_generate_tokens_per_second"] > 0 and row["benchmark_vs_plain_generate"] > 0
        assert len(row["plain_generate_ms_per_token_all"]) == 2 * 4


def test_format_names_round_trip():
    for dtype in ("float32", "bfloat16"):
        for quantize in (None, "int8"):
            assert parse_format(format_name(dtype, quantize)) == (dtype, quantize)


@pytest.mark.parametrize(
    "dtype,quantize,match",
    [("float16", None, "--dtype"), ("float32", "int4", "--quantize"), ("bfloat16", "fp8", "--quantize")],
)
def test_bad_formats_are_one_line_errors(dtype, quantize, match):
    with pytest.raises(ConfigError, match=match):
        check_weight_format(dtype, quantize)


def test_generate_quantize_int4_is_one_line(capsys, tmp_path):
    err = one_line_error(capsys, ["generate", str(tmp_path), "--prompt", "x", "--quantize", "int4"])
    assert "--quantize 'int4'" in err and "int8" in err


def test_bench_generate_bad_format_is_one_line(capsys):
    err = one_line_error(capsys, ["bench", "generate", "--dtype", "float32,float16", "--no-progress"])
    assert "--dtype 'float16'" in err
    err = one_line_error(capsys, ["bench", "generate", "--quantize", "none,int4", "--no-progress"])
    assert "--quantize 'int4'" in err


def test_apply_weight_format_is_a_no_op_in_float32():
    model = tiny_model("llama")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    info = apply_weight_format(model, "float32", None)
    assert info["format"] == "float32" and info["int8_linears"] == 0
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
