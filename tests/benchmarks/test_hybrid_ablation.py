"""``benchmarks/hybrid_ablation.py`` end to end on a tiny 4-layer teacher: every variant trains
through the real trainer and the JSON records perplexities, orderings, budgets and the command."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoModelForCausalLM

from bench_scripts import load_benchmark
from tiny_models import make_tokenizer, tiny_config


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("hybrid_ablation.py")


def test_tiny_run_writes_json_and_png(bench, tmp_path):
    tok = make_tokenizer(300)
    cfg = tiny_config("llama")
    cfg.vocab_size, cfg.max_position_embeddings, cfg.num_hidden_layers = len(tok), 128, 4
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    rng = random.Random(0)
    words = "the union state people congress nation law work peace war".split()
    (tmp_path / "corpus").mkdir()
    for i in range(12):
        (tmp_path / "corpus" / f"d{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    out = tmp_path / "results"
    argv = [
        "--teacher",
        str(tmp_path / "teacher"),
        "--corpus",
        str(tmp_path / "corpus"),
        "--tokens",
        "128",
        "--eval-tokens",
        "256",
        "--block-len",
        "32",
        "--runs",
        str(tmp_path / "runs"),
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    data = json.loads((out / "hybrid_ablation.json").read_text())
    assert set(data["variants"]) == set(bench.variants(128))
    for result in data["variants"].values():
        assert result["student_ppl"] > 1 and result["train_tokens"] == 128
    assert set(data["untrained_50pct"]) == {"attention init", "random init"}
    assert all(v["holds"] in (True, False) for v in data["comparisons"].values())
    assert data["command"].startswith("python benchmarks/hybrid_ablation.py") and "environment" in data
    assert (out / "hybrid_ablation.png").read_bytes()[:4] == b"\x89PNG"
    assert not any((tmp_path / "runs").iterdir())  # scratch runs are removed
