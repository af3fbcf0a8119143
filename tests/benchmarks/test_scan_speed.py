"""``benchmarks/scan_speed.py``: a tiny run in-process writes a well-formed JSON + PNG."""

from __future__ import annotations

import json

import pytest
import torch

from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("scan_speed.py")


def test_tiny_run_writes_json_and_png(bench, tmp_path, one_thread):
    out = tmp_path / "scan.json"
    argv = [
        "--lengths",
        "16,40",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--max-sequential-len",
        "16",
        "--speedup-length",
        "16",
        "--chunk-size",
        "8",
        "--ssd-shape",
        "2,4,4",
        "--scan-shape",
        "2,3,4",
        "--sdpa-shape",
        "2,4",
        "--out",
        str(out),
    ]
    result = bench.main(argv)
    data = json.loads(out.read_text())
    assert data["points"] == result["points"]  # the file holds what main returned
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    points = {(p["method"], p["length"]): p for p in data["points"]}
    assert set(points) == {(m, L) for m in bench.METHODS for L in (16, 40)}
    for (method, length), p in points.items():
        if method in ("ssd_loop", "scan_loop") and length == 40:  # above --max-sequential-len
            assert p["status"] == "skipped" and p["time_s"] is None and "max-sequential-len" in p["reason"]
        else:
            assert p["status"] == "ok" and p["time_s"] > 0 and p["repeats"] == 1
    s = data["summary"]["cpu"]
    assert s["speedup_ssd_chunked_vs_loop_at_16"] > 0 and s["speedup_target"] == 10.0
    assert isinstance(s["meets_target"], bool)
    assert s["time_s"]["ssd_loop"]["40"] is None and s["time_s"]["sdpa"]["40"] > 0
    assert set(s["sdpa_time_over_ssd_chunked"]) == {"16", "40"}
    cfg = data["config"]
    assert cfg["ssd"] == {"heads": 2, "head_dim": 4, "state_dim": 4}
    assert cfg["selective_scan"] == {"groups": 2, "channels_per_group": 3, "state_dim": 4}
    assert cfg["torch_threads"] == 1 and cfg["max_sequential_len"] == 16
    assert data["command"].startswith("python benchmarks/scan_speed.py --lengths 16,40")
    assert data["environment"]["torch"] == torch.__version__


def test_summary_ratios(bench):
    def rec(method, length, t):
        return {"method": method, "device": "cpu", "length": length, "status": "ok", "time_s": t}

    records = [
        rec("ssd_chunked", 4096, 0.1),
        rec("ssd_loop", 4096, 2.5),
        rec("sdpa", 4096, 0.5),
        {"method": "ssd_loop", "device": "cpu", "length": 8192, "status": "skipped", "time_s": None},
        rec("ssd_chunked", 8192, 0.2),
    ]
    s = bench.summarize(records, 4096)["cpu"]
    assert s["speedup_ssd_chunked_vs_loop_at_4096"] == pytest.approx(25.0) and s["meets_target"] is True
    assert s["sdpa_time_over_ssd_chunked"]["4096"] == pytest.approx(5.0)
    assert s["sdpa_time_over_ssd_chunked"]["8192"] is None
    assert s["time_s"]["ssd_loop"]["8192"] is None
