"""benchmarks/mqar.py: the MQAR generator is right, and ``--quick`` runs end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def mqar():
    return load_benchmark("mqar.py")


CONFIGS = [
    dict(vocab_size=32, num_kv_pairs=4, seq_len=32, num_queries=4),
    dict(vocab_size=64, num_kv_pairs=16, seq_len=64, num_queries=16),
    dict(vocab_size=64, num_kv_pairs=8, seq_len=40, num_queries=3),
    dict(vocab_size=9, num_kv_pairs=3, seq_len=7, num_queries=1),  # tightest: all keys used, 1 slot
]


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_every_target_is_the_value_paired_with_that_key(mqar, kwargs):
    cfg = mqar.MQARConfig(**kwargs)
    x, y = mqar.make_mqar(200, cfg, seed=3)
    N, Q, L, V = cfg.num_kv_pairs, cfg.num_queries, cfg.seq_len, cfg.vocab_size
    assert x.shape == y.shape == (200, L) and x.dtype == y.dtype == torch.long
    key_set, value_set = set(range(1, V // 2)), set(range(V // 2, V))
    assert key_set.isdisjoint(value_set) and 0 not in key_set | value_set
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0 : 2 * N : 2], row_x[1 : 2 * N : 2]
        assert set(keys) <= key_set and set(values) <= value_set  # disjoint halves
        assert len(set(keys)) == N  # distinct keys: each query has exactly one answer
        pairs = dict(zip(keys, values))
        assert all(t == -100 for t in row_y[: 2 * N])  # no loss inside the kv section
        queries = [p for p in range(L) if row_y[p] != -100]
        assert len(queries) == Q and len({row_x[p] for p in queries}) == Q
        for p in range(2 * N, L):
            if p in queries:
                key = row_x[p]
                assert key in key_set
                assert row_x[:p].index(key) < 2 * N  # seen earlier, in the kv section
                assert row_y[p] == pairs[key]  # the value paired with it
            else:
                assert row_x[p] == 0  # filler


def test_generator_is_deterministic_by_seed(mqar):
    cfg = mqar.MQARConfig()
    a, b, c = (mqar.make_mqar(64, cfg, seed=s) for s in (7, 7, 8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    # Test samples are fresh: no test sequence equals a training batch sequence.
    train = torch.cat([mqar.make_mqar(32, cfg, seed=s)[0] for s in range(20)])
    test = mqar.make_mqar(256, cfg, seed=10_000_019)[0]
    assert not (test[:, None, :] == train[None, :, :]).all(-1).any()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vocab_size=16, num_kv_pairs=8, seq_len=32, num_queries=4),  # only 7 keys (1..7)
        dict(vocab_size=64, num_kv_pairs=4, seq_len=32, num_queries=5),  # more queries than pairs
        dict(vocab_size=64, num_kv_pairs=8, seq_len=18, num_queries=4),  # no room for the queries
    ],
)
def test_impossible_configs_are_rejected(mqar, kwargs):
    with pytest.raises(ValueError):
        mqar.make_mqar(2, mqar.MQARConfig(**kwargs), seed=0)


def test_row_entropy(mqar):
    w = torch.tensor(
        [[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5e-6, 0.5e-6, 0, 0]]
    )
    h, alive = mqar.row_entropy(w)
    assert h[0].item() == pytest.approx(math.log(4)) and h[1].item() == pytest.approx(0.0)
    assert alive.tolist() == [True, True, False, False]


def test_quick_run_writes_json_and_png_with_every_model(mqar, tmp_path):
    from attn2ssm.mixers.feature_maps import FEATURE_MAPS

    argv = ["--quick", "--steps", "20", "--out", str(tmp_path), "--no-progress"]
    mqar.run(argv)
    report = json.loads((tmp_path / "mqar.json").read_text())
    assert (tmp_path / "mqar.png").stat().st_size > 0
    assert list(report["models"]) == ["softmax", *mqar.DEFAULT_MAPS]
    assert report["settings"]["train"]["steps"] == 20 and report["settings"]["quick"] is True
    assert report["command"] == "python benchmarks/mqar.py " + " ".join(argv)
    assert {"torch", "transformers", "attn2ssm", "machine"} <= set(report["environment"])
    for name, entry in report["models"].items():
        if name != "softmax" and name not in FEATURE_MAPS:
            assert entry["status"].startswith("unavailable")  # map not implemented (yet)
            continue
        assert entry["status"] == "ok", (name, entry["status"])
        assert entry["steps_done"] == 20
        assert 0.0 <= entry["accuracy"] <= 1.0
        assert 0.0 <= entry["entropy"] and 0.0 <= entry["dead_row_fraction"] < 1.0
        if entry["dead_row_fraction"] == 0.0:  # same rows as the uniform reference: bounded by it
            assert entry["entropy"] <= report["settings"]["uniform_attention_entropy"]["entropy"] + 1e-6
        assert entry["train_time_s"] > 0
    # Nearly untrained, init std 0.02: every model's attention is close to uniform.
    assert report["models"]["softmax"]["entropy"] == pytest.approx(
        report["settings"]["uniform_attention_entropy"]["entropy"], abs=0.05
    )
