"""benchmarks/gpu/train_plan.py plan: the GPU run's token budgets from measured rates, split between the
main run's two stages as the base recipe splits them (the third GPU run's fixed 1:3 inverted
gdn_hybrid25's 3:1 and gave hidden alignment 12 steps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "train_plan.py"


def _plan(tmp_path, *flags):
    rates = tmp_path / "rates.json"
    rates.write_text(
        json.dumps({"hidden_alignment": {"tokens_per_s": 20000.0}, "finetune": {"tokens_per_s": 10000.0}})
    )
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "plan", str(rates), *flags], capture_output=True, text=True, timeout=120
    )
    return r


def test_the_main_run_is_split_as_the_recipe_splits_it(tmp_path):
    r = _plan(tmp_path, "--seconds", "100", "--final-seconds", "40", "--recipe", "gdn_hybrid25")
    assert r.returncode == 0, r.stderr
    t1, t2, t3 = map(int, r.stdout.split())
    # gdn_hybrid25: hidden alignment 49,152 and KD 16,384 tokens -> f = 0.75;
    # T = 0.8 * 100 / (0.75 / 20000 + 0.25 / 10000) = 1,280,000; final: 0.8 * 40 * 10000 * 0.25 = 80,000
    assert (t1, t2, t3) == (960_000, 320_000, 80_000)


def test_a_given_share_wins_and_no_share_is_one_line(tmp_path):
    r = _plan(tmp_path, "--seconds", "100", "--final-seconds", "40", "--first-share", "0.5")
    t1, t2, _ = map(int, r.stdout.split())
    assert t1 == t2 == pytest.approx(0.5 * 0.8 * 100 / (0.5 / 20000 + 0.5 / 10000), abs=1)
    r = _plan(tmp_path, "--seconds", "100", "--final-seconds", "40")
    assert r.returncode != 0 and "plan needs --recipe BASE" in r.stderr
