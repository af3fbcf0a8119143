"""``bench quality`` budgets have an upper bound (issue 46, wording): ``2^99`` is a one-line error
naming the largest budget, 2^40 tokens, before anything is planned or written; and an exponent too
large to compute is refused at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from attn2ssm.bench.quality import MAX_BUDGET, parse_budgets, select_cells
from attn2ssm.errors import ConfigError


def test_the_largest_budget_is_2_to_the_40():
    assert MAX_BUDGET == 2**40
    assert parse_budgets("2^40,65536") == (65536, 2**40)
    assert parse_budgets(str(2**40)) == (2**40,)


@pytest.mark.parametrize("text", ["2^99", "2^41", str(2**40 + 1), "3^26", "2**64"])
def test_a_budget_past_2_to_the_40_is_refused(text):
    with pytest.raises(ConfigError, match=r"--budgets .* is more than the largest budget, 2\^40 tokens"):
        parse_budgets(text)
    with pytest.raises(ConfigError, match=r"--only .* is more than the largest budget"):
        select_cells({"q": "quickstart"}, None, None, f"q@{text}")


def test_an_exponent_too_large_to_compute_is_refused_at_once():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="more than the largest budget"):
        parse_budgets("2^99999999999")
    assert time.perf_counter() - start < 1.0
    for bad in ("2^-3", "2^3^4"):  # a negative power or two carets: not a token count
        with pytest.raises(ConfigError, match="is not a positive token count"):
            parse_budgets(bad)


def test_plan_with_a_budget_of_2_to_the_99_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    grid, out = tmp_path / "grid", tmp_path / "q.json"
    argv = [sys.executable, "-m", "attn2ssm", "bench", "quality", "--plan", "--families", "mamba2"]
    argv += ["--budgets", "2^99", "--out-dir", str(grid), "--json", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: --budgets '2^99' is more than"), r.stderr
    assert "write budgets up to 2^40 = 1099511627776" in r.stderr and r.stdout == ""
    assert not grid.exists() and not out.exists()
