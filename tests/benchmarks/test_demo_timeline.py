"""``benchmarks/demo_timeline.py``: the demo's phases and printed figures read from its output lines."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def timeline():
    return load_benchmark("demo_timeline.py")


def _events(*pairs):
    return [{"t_s": t, "line": line} for t, line in pairs]


EVENTS = _events(
    (0.0, ".venv/bin/python -m pip install -q pip"),
    (4.0, "converting built-in teacher smollm2-135m from GGUF (once) …"),
    (20.0, "data: 60 training blocks, 53 held-out blocks of 1024 tokens"),
    (27.0, "scoring layers:   0%|          | 0/30 [00:00<?, ?it/s]"),
    (40.0, "scoring layers:  50%|█████     | 15/30 [00:13<00:13, 1.1it/s]"),
    (60.0, "scoring layers: 100%|██████████| 30/30 [00:33<00:00, 1.1it/s]"),
    (61.0, "automatic layer selection: keeping attention in layers [8, 10]"),
    (62.0, "[stage 1/2] attention_transfer (attention_transfer): 30 steps"),
    (200.0, "[stage 2/2] finetune (kd): 10 steps"),
    (400.0, "model        held-out ppl"),
    (400.0, "teacher             27.33"),
    (400.0, "student             34.65"),
    (401.0, "== teacher vs student on held-out text of three domains"),
    (500.0, "== the teacher (SmolLM2-135M-Instruct), greedy =="),
)


def test_phases_run_from_each_marker_to_the_next(timeline):
    assert timeline.phases(EVENTS, 510.0) == {
        "install": 4.0,
        "teacher conversion": 16.0,
        "data": 7.0,
        "layer selection": 35.0,
        "stage 1": 138.0,
        "stage 2 and the run's held-out score": 201.0,
        "the suite's rows": 99.0,
        "the two continuations": 10.0,
    }
    # a phase whose marker never printed (a resumed run skips layer selection) is left out
    resumed = [e for e in EVENTS if "scoring layers" not in e["line"]]
    assert "layer selection" not in timeline.phases(resumed, 510.0)
    assert timeline.phases(resumed, 510.0)["data"] == 42.0


def test_progress_bar_redraws_keep_their_first_and_last_line(timeline):
    kept = timeline.compressed(EVENTS)
    bars = [e["t_s"] for e in kept if e["line"].startswith("scoring layers")]
    assert bars == [27.0, 60.0] and len(kept) == len(EVENTS) - 1


def test_printed_results_read_the_table_and_the_suite_rows(timeline, tmp_path):
    suite = tmp_path / "runs" / "demo" / "suite"
    suite.mkdir(parents=True)
    row = {"id": "ppl/kjv/1024", "teacher": 11.88, "student": 18.41, "ratio": 1.55, "n": 4095, "extra": 1}
    (suite / "suite.json").write_text(json.dumps({"rows": [row]}))
    got = timeline.printed_results(EVENTS, tmp_path)
    assert got["teacher_ppl"] == 27.33 and got["student_ppl"] == 34.65
    assert got["suite_rows"] == [
        {k: row[k] for k in ("id", "teacher", "student", "ratio", "n")} | {"cpu_seconds": None}
    ]
