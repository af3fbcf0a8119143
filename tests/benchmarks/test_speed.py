"""``benchmarks/linear_attention_speed.py``: a --quick run in-process, the skip logic, the memory probe."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("linear_attention_speed.py")


def test_quick_run_writes_json_with_all_methods(bench, tmp_path, one_thread):
    out = tmp_path / "speed.json"
    result = bench.main(
        [
            "--quick",
            "--lengths",
            "32,64",
            "--heads",
            "3",
            "--isolation",
            "none",
            "--threads",
            "1",
            "--devices",
            "cpu",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["points"] == result["points"]  # the file holds what main returned
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    ok = {(p["method"], p["length"]) for p in data["points"] if p["status"] == "ok"}
    assert ok == {(m, L) for m in ("sdpa", "hedgehog", "taylor", "elu") for L in (32, 64)}, data["points"]
    for p in data["points"]:
        assert p["time_s"] > 0 and p["peak_memory_bytes"] >= 0 and p["repeats"] == 1
    # Taylor's f = 1 + 64 + 64² features cost far more memory than 1+ELU's 64.
    mem = {(p["method"], p["length"]): p["peak_memory_bytes"] for p in data["points"]}
    assert mem[("taylor", 64)] > 10 * mem[("elu", 64)]
    assert data["config"]["feature_dims"] == {"sdpa": None, "hedgehog": 128, "taylor": 4161, "elu": 64}
    assert "crossover_hedgehog_vs_sdpa" in data["summary"]["cpu"]
    assert "speedup_hedgehog_vs_sdpa_at_16384" in data["summary"]["cpu"]
    assert data["command"].startswith("python benchmarks/linear_attention_speed.py --quick")
    assert data["environment"]["torch"] == torch.__version__


def test_points_over_the_limits_are_skipped_with_a_reason(bench, tmp_path, one_thread):
    out = tmp_path / "skip.json"
    bench.main(
        [
            "--lengths",
            "32,2048,4096",
            "--methods",
            "elu",
            "--repeats",
            "1",
            "--isolation",
            "none",
            "--threads",
            "1",
            "--devices",
            "cpu",
            "--max-memory-gb",
            "0.01",
            "--out",
            str(out),
        ]
    )
    points = {p["length"]: p for p in json.loads(out.read_text())["points"]}
    assert points[32]["status"] == "ok"
    assert points[2048]["status"] == "skipped" and "memory" in points[2048]["reason"]
    assert points[4096]["status"] == "skipped" and "shorter length" in points[4096]["reason"]


def test_crossover_and_summary(bench):
    def rec(method, length, t):
        return {"method": method, "device": "cpu", "length": length, "status": "ok", "time_s": t}

    records = [
        rec("sdpa", 512, 1.0),
        rec("hedgehog", 512, 2.0),
        rec("sdpa", 1024, 2.0),
        rec("hedgehog", 1024, 2.5),
        rec("sdpa", 2048, 6.0),
        rec("hedgehog", 2048, 3.0),
        rec("sdpa", 16384, 100.0),
        rec("hedgehog", 16384, 20.0),
    ]
    s = bench.summarize(records)["cpu"]
    assert s["crossover_hedgehog_vs_sdpa"]["length"] == 2048
    assert 1024 < s["crossover_hedgehog_vs_sdpa"]["interpolated"] < 2048
    assert s["speedup_hedgehog_vs_sdpa_at_16384"] == pytest.approx(5.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via /proc is Linux-only")
def test_rss_probe_sees_a_known_allocation(bench):
    """The CPU memory method must see torch allocations (tracemalloc would not)."""
    bench._set_mmap_threshold()
    assert bench._reset_peak_rss()
    rss0 = bench._proc_status_kib("VmRSS")
    x = torch.ones(16 * 2**20)  # 64 MiB, every page written
    del x
    peak = (bench._proc_status_kib("VmHWM") - rss0) * 1024
    assert 60 * 2**20 < peak < 80 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via /proc is Linux-only")
def test_a_point_in_a_process_whose_heap_holds_freed_memory_still_sees_its_allocations(bench, one_thread):
    """A long-lived process (a test session) holds freed heap memory from before the mmap threshold
    was set; a step that reused it unseen read 0 MiB for every method (CI, 2026-12-03)."""
    big = torch.ones(5 * 2**20)  # a freed mmapped block raises glibc's dynamic mmap threshold...
    del big
    held = [torch.ones(2**20) for _ in range(100)]  # ...so 400 MiB more go through the heap,
    pin = torch.ones(1024)  # and a block above them keeps glibc from trimming them off the top
    del held
    bench._set_mmap_threshold()
    spec = {"device": "cpu", "length": 64, "heads": 3, "head_dim": 64, "chunk_size": 64, "dtype": "float32"}
    spec.update(repeats=1, seed=0, point_budget=60, threads=1)
    mem = {m: bench.run_point({**spec, "method": m})["peak_memory_bytes"] for m in ("taylor", "elu")}
    # Taylor's step holds its 1 + 64 + 64² features of q and k: ~20 MiB here, 1+ELU's well under 1.
    assert mem["taylor"] > 8 * 2**20 and mem["taylor"] > 10 * mem["elu"], mem
    del pin
