"""``benchmarks/logit_cache.py`` (b): a KD step with a cache hit against one that runs the teacher,
measured through ``bench train``'s public ``measure_point`` (the script called a private helper
with an argument short, and could not be imported outside its own folder: it now puts
benchmarks/ on sys.path as the other scripts do)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from bench_scripts import load_benchmark
from tiny_models import make_tokenizer, tiny_config, write_corpus


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("logit_cache.py")


def test_speed_pairs_the_cached_and_uncached_kd_step(bench, tmp_path):
    tokenizer = make_tokenizer(300)
    cfg = tiny_config("llama")
    cfg.vocab_size, cfg.max_position_embeddings = len(tokenizer), 1024  # the script's 1024-token blocks
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    corpus = str(write_corpus(tmp_path / "corpus"))
    out = bench.measure_speed(teacher, tokenizer, reps=1, step_tokens=1024, precisions=("no",), corpus=corpus)
    (row,) = out["rows"]
    assert row["precision"] == "no" and row["speedup"] > 0
    assert row["cached"]["case"] == "kd_lora_cached" and row["cached"]["logit_cache"]["misses"] == 0
    assert row["uncached"]["case"] == "kd_lora" and out["summary"]["no"]["speedup_median"] > 0
