"""``mixed_precision: auto``: bf16 only where it is fast, with the machine's capability faked.

The CPU's flags (``cpu_native_bf16``) and the micro-benchmark (``_measure_bf16``) are replaced by
fakes, so every branch runs on any machine; one test measures the real probe once.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from attn2ssm import precision
from attn2ssm.distill.recipe import builtin_recipes, load_recipe
from attn2ssm.distill.trainer import Distiller
from attn2ssm.precision import Bf16Probe, choose_precision, cpu_bf16_probe, warn_if_slow_bf16
from tiny_models import BASE_RECIPE

FAST = Bf16Probe(fp32_ms=10.0, bf16_ms=2.5)  # a CPU with native bf16: 4x faster
SLOW = Bf16Probe(fp32_ms=10.0, bf16_ms=90.0)  # an AVX2-only CPU: bf16 emulated, 9x slower
EVEN = Bf16Probe(fp32_ms=10.0, bf16_ms=9.0)  # 1.11x: not worth bf16's rounding


@pytest.fixture
def fake_cpu(monkeypatch, tmp_path):
    """A function (native flag, probe) → installs them; counts how often the probe is measured.
    The probe's cache file goes to a private folder: a fake answer never reaches other tests."""
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path / "cache"))
    calls = []
    precision.cpu_bf16_probe.cache_clear()
    precision._warned.clear()

    def install(native, probe):
        monkeypatch.setattr(precision, "cpu_native_bf16", lambda: native)

        def measure():
            calls.append(1)
            return probe

        monkeypatch.setattr(precision, "_measure_bf16", measure)
        return calls

    yield install
    precision.cpu_bf16_probe.cache_clear()
    precision._warned.clear()


def test_explicit_settings_are_kept(fake_cpu):
    calls = fake_cpu(False, SLOW)
    for asked in ("no", "bf16", "fp16"):
        choice = choose_precision(asked, "cpu")
        assert (choice.requested, choice.used) == (asked, asked)
    assert calls == []  # nothing measured for an explicit setting


def test_x86_without_bf16_flags_is_fp32_without_measuring(fake_cpu):
    calls = fake_cpu(False, FAST)  # even a (wrong) fast probe is not consulted: the flags decide
    choice = choose_precision("auto", "cpu")
    assert choice.used == "no" and "AVX512-BF16/AMX" in choice.reason
    assert calls == []


@pytest.mark.parametrize("native", [True, None])  # None: flags unknown (e.g. ARM): the probe decides
@pytest.mark.parametrize("probe, used", [(FAST, "bf16"), (SLOW, "no"), (EVEN, "no")])
def test_cpu_with_bf16_flags_or_unknown_follows_the_probe(fake_cpu, native, probe, used):
    fake_cpu(native, probe)
    choice = choose_precision("auto", torch.device("cpu"))
    assert choice.used == used
    assert f"{max(probe.speedup, 1 / probe.speedup):.1f}x" in choice.reason


def test_a_capped_isa_is_a_different_machine(fake_cpu, monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 on an AVX512-BF16 CPU emulates bf16: the cached answer must not carry over."""
    calls = fake_cpu(True, FAST)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert choose_precision("auto", "cpu").used == "bf16"
    precision.cpu_bf16_probe.cache_clear()
    assert choose_precision("auto", "cpu").used == "bf16" and len(calls) == 1  # read back from the cache file
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    precision.cpu_bf16_probe.cache_clear()
    monkeypatch.setattr(precision, "_measure_bf16", lambda: calls.append(1) or SLOW)
    assert choose_precision("auto", "cpu").used == "no" and len(calls) == 2


def test_probe_is_cached_per_machine_and_survives_a_damaged_file(fake_cpu, tmp_path):
    calls = fake_cpu(True, SLOW)
    file = tmp_path / "cache" / "precision_probe.json"
    assert cpu_bf16_probe() == SLOW
    stored = json.loads(file.read_text())
    assert list(stored.values()) == [{"fp32_ms": 10.0, "bf16_ms": 90.0}]
    precision.cpu_bf16_probe.cache_clear()
    assert cpu_bf16_probe() == SLOW and len(calls) == 1
    file.write_text("{not json")
    precision.cpu_bf16_probe.cache_clear()
    assert cpu_bf16_probe() == SLOW and len(calls) == 2  # measured again, and the file mended
    assert json.loads(file.read_text())


def test_cuda_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_precision("auto", "cuda").used == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    choice = choose_precision("auto", "cuda:0")
    assert choice.used == "no" and "Fake GPU" in choice.reason


def test_explicit_bf16_on_a_slow_cpu_warns_once_with_the_slowdown(fake_cpu):
    fake_cpu(False, SLOW)
    with pytest.warns(UserWarning, match=r"9\.0x the time of fp32 \(90\.0 vs 10\.0 ms"):
        assert warn_if_slow_bf16("cpu", "mixed_precision: bf16", "set mixed_precision: auto") == SLOW
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_slow_bf16("cpu", "mixed_precision: bf16", "set mixed_precision: auto") is None  # once


def test_bf16_where_it_is_fast_does_not_warn(fake_cpu):
    fake_cpu(True, FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_slow_bf16("cpu", "x", "y") is None
        assert warn_if_slow_bf16("cuda", "z", "y") is None  # not a CPU: never probed


def test_bf16_decode_weights_warn_on_a_slow_cpu(fake_cpu):
    from attn2ssm.decode.quantize import apply_weight_format

    fake_cpu(False, SLOW)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="--dtype bfloat16.*prefill"):
        apply_weight_format(model, "bfloat16")
    assert model[0].weight.dtype == torch.bfloat16


def test_no_builtin_recipe_forces_a_reduced_precision():
    """Fast on every machine: a built-in recipe is `auto` (those tuned under bf16) or fp32, never a forced bf16."""
    settings = {name: load_recipe(name).mixed_precision for name in builtin_recipes()}
    assert set(settings.values()) <= {"auto", "no"}, settings
    for name in (
        "quickstart",
        "lolcats",
        "linear_hybrid25",
        "mamba2_pure",
        "hybrid12",
        "hybrid25",
        "hybrid50",
    ):
        assert settings[name] == "auto", name
    assert load_recipe("quickstart", ["mixed_precision=no"]).mixed_precision == "no"


def test_the_distiller_uses_and_reports_the_choice(fake_cpu, run_overrides, tmp_path):
    """On a CPU faked without native bf16, an `auto` run trains in fp32 and says so in results.json."""
    fake_cpu(False, SLOW)
    overrides = run_overrides(
        **{"mixed_precision": "auto", "stages": "[{name: kd, kind: kd, tokens: 256, batch_size: 4}]"}
    )
    distiller = Distiller(load_recipe(BASE_RECIPE, overrides), tmp_path / "run", progress=False)
    assert distiller.acc.mixed_precision == "no"
    results = distiller.run()
    assert results["mixed_precision"] == {
        "requested": "auto",
        "used": "no",
        "reason": choose_precision("auto", "cpu").reason,
    }
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (
        saved["mixed_precision"]["used"] == "no"
        and saved["kernels"]["used"] == "torch"
        and saved["device"] == "cpu"
    )
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps and all(r["kernels"] == "torch" for r in steps)  # every step says which kernels ran


def test_the_real_probe_measures_something(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path))
    precision.cpu_bf16_probe.cache_clear()
    try:
        probe = cpu_bf16_probe()
    finally:
        precision.cpu_bf16_probe.cache_clear()
    assert probe.fp32_ms > 0 and probe.bf16_ms > 0
