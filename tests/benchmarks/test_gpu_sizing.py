"""benchmarks/gpu/gpu_plan.py: the GPU run's arithmetic against hand-computed values (the
square-root learning-rate rule, the step that fits the measured memory, the token budgets, MFU),
and the carry check, which refuses an oversize device call in one line before any GPU call."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import gpu_plan  # noqa: E402

MIB = 1 << 20


def test_the_learning_rate_grows_with_the_square_root_of_the_step_up_to_its_cap():
    # linear_hybrid25's KD stage: lr 1e-3 for one 2048-token block a step
    assert gpu_plan.lr_for_step(1e-3, 2048, 8192) == pytest.approx(2e-3)  # 4x the tokens: x2
    assert gpu_plan.lr_for_step(1e-3, 2048, 2048) == pytest.approx(1e-3)
    assert gpu_plan.lr_for_step(1e-3, 2048, 512) == pytest.approx(5e-4)  # a smaller step: x1/2
    # 65,536 tokens: sqrt(32) = 5.66, capped at 4
    assert gpu_plan.lr_for_step(1e-2, 2048, 65536) == pytest.approx(4e-2)
    assert gpu_plan.lr_for_step(1e-2, 2048, 65536, cap=8.0) == pytest.approx(1e-2 * 32**0.5)


def test_the_step_is_the_largest_that_fits_the_measured_memory():
    gib = 1 << 30
    # 0.85 x 140 GiB - 20 GiB = 99 GiB free; 1 MiB of activations a token -> 101,376 tokens; 4096-token blocks: 24
    assert gpu_plan.fit_batch(4096, 20 * gib, MIB, 140 * gib, 1 << 17) == 24
    # capped by the largest step: 131,072 / 1024 = 128 blocks
    assert gpu_plan.fit_batch(1024, 20 * gib, 1024, 140 * gib, 1 << 17) == 128
    # not one block fits: 0 (the stage then keeps activation checkpointing)
    assert gpu_plan.fit_batch(4096, 100 * gib, 8 * MIB, 140 * gib, 1 << 17) == 0


def test_budgets_fill_the_seconds_in_the_recipe_s_split_in_whole_steps():
    # weights 3:1, rates 20k and 10k tok/s, 100 s at safety 0.8: s = 80 / (3/20000 + 1/10000) = 320,000
    # -> 960,000 and 320,000 tokens, rounded down to steps of 65,536 and 32,768
    assert gpu_plan.stage_budgets([3, 1], [20000.0, 10000.0], [65536, 32768], 100, 0.8) == [
        14 * 65536,
        9 * 32768,
    ]
    # at least one step each
    assert gpu_plan.stage_budgets([1, 1], [1.0, 1.0], [4096, 4096], 1, 0.8) == [4096, 4096]


def test_mfu_against_the_peak_and_against_the_measured_teacher_forward():
    # 135M teacher, 140M student: 2 x 135M + 6 x 140M = 1.11 GFLOP a token; 100k tok/s = 111 TFLOP/s
    out = gpu_plan.mfu(100_000, 135_000_000, 140_000_000, 400_000)
    assert out["flops_per_token"] == 1.11e9
    assert out["mfu_peak"] == pytest.approx(1.11e14 / 989e12)
    assert out["mfu_peak_low"] == pytest.approx((2.7e8 + 5.6e8) * 1e5 / 989e12)
    # the teacher forward at 400k tok/s runs 2 x 135M x 400k = 108 TFLOP/s
    assert out["teacher_forward_flops_per_s"] == pytest.approx(1.08e14)
    assert out["mfu_teacher_bound"] == pytest.approx(1.11e14 / 1.08e14)
    assert out["share_of_teacher_forward_rate"] == 0.25
    assert "mfu_teacher_bound" not in gpu_plan.mfu(1.0, 1, 1, None)


def _tree(tmp_path, carried_mib: int):
    """A git tree with 1 MiB tracked, an ignored .whl/ of ``carried_mib`` MiB and a 2 MiB ignored part."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "src.py").write_bytes(b"x" * MIB)
    (tmp_path / ".gitignore").write_text("/.whl/\n/.gpu_train/\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "big.whl").write_bytes(b"\0" * (carried_mib * MIB))
    (tmp_path / ".gpu_train" / "part1").mkdir(parents=True)
    (tmp_path / ".gpu_train" / "part1" / "p.part0").write_bytes(b"\0" * (2 * MIB))
    return tmp_path


def test_a_call_that_fits_is_reported_with_its_parts(tmp_path):
    root = _tree(tmp_path, 10)
    report = gpu_plan.check_carry(root, {"1": [".whl", ".gpu_train/part1"]})
    assert report["1"]["fits"] and report["1"]["parts"][".whl"] == 10 * MIB
    assert report["1"]["bytes"] == MIB + len("/.whl/\n/.gpu_train/\n") + 12 * MIB  # tree + carried


def test_an_oversize_carry_is_refused_in_one_line_naming_the_largest_file(tmp_path):
    root = _tree(tmp_path, 62)  # 1 MiB tree + 62 + 2 > 64
    with pytest.raises(SystemExit) as err:
        gpu_plan.check_carry(root, {"1": [".gpu_train/part1"], "2": [".whl", ".gpu_train/part1"]})
    message = str(err.value)
    assert "\n" not in message and message.startswith("carry check: call 2 takes 65.0 MiB, over the 64 MiB")
    assert "largest file .whl/big.whl (62.0 MiB)" in message


def test_the_carry_command_fails_loudly_and_names_a_missing_path(tmp_path):
    root = _tree(tmp_path, 63)
    script = ROOT / "benchmarks" / "gpu" / "distill_on_gpu.py"
    argv = [sys.executable, str(script), "carry", "--root", str(root), "--call", "1=.whl"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().startswith("carry check: call 1 takes 64.0 MiB")
    r = subprocess.run([*argv[:-1], "1=.gpu_train/part9"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "carries .gpu_train/part9, which does not exist" in r.stderr
    r = subprocess.run([*argv[:-1], "1=.gpu_train/part1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("call 1: 3.0 of 64 MiB")
