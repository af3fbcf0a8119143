"""benchmarks/length_ablation.py: the model specs, the ratios, and a run from cached scores."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def ablation():
    return load_benchmark("length_ablation.py")


def test_model_specs(ablation):
    assert ablation.parse_model("base=runs/demo/student") == ("base", "runs/demo/student", "both")
    assert ablation.parse_model("w=runs/d/student@window") == ("w", "runs/d/student", "window")
    for bad in ("runs/demo/student", "x=", "x=p@sideways"):
        with pytest.raises(SystemExit):
            ablation.parse_model(bad)


def test_eval_command_asks_for_the_branch_only_when_it_is_not_both(ablation, tmp_path):
    cmd = ablation.eval_command("S", "window", "kjv", 4096, 8192, tmp_path / "o.json")
    assert cmd[-2:] == ["--branch", "window"] and cmd[cmd.index("--window") + 1] == "4096"
    assert "--branch" not in ablation.eval_command("S", "both", "kjv", 4096, 8192, tmp_path / "o.json")


def test_a_run_from_cached_scores_writes_the_ratios(ablation, tmp_path):
    scores = {("teacher", 1024): 10.0, ("teacher", 4096): 8.0, ("s", 1024): 13.0, ("s", 4096): 16.0}
    for (name, w), ppl in scores.items():
        (tmp_path / f"ppl-{name}-{w}.json").write_text(json.dumps({"model": {"ppl": ppl}}))
    out = tmp_path / "res" / "length_ablation.json"
    result = ablation.main(
        ["--model", "s=nowhere", "--windows", "1024,4096", "--cache", str(tmp_path), "--out", str(out)]
    )
    ratios = {(r["model"], r["window"]): r["ratio"] for r in result["rows"]}
    assert ratios[("s", 1024)] == pytest.approx(1.3) and ratios[("s", 4096)] == pytest.approx(2.0)
    assert ratios[("teacher", 4096)] == pytest.approx(1.0)
    assert (
        json.loads(out.read_text())["rows"] == result["rows"] and out.with_suffix(".png").stat().st_size > 0
    )
