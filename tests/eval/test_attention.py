"""Attention fidelity (``attn2ssm.eval.attention``): metrics, rank statistics, heat-maps, CLI.

The teacher is a tiny random Llama (vocab widened to the test tokenizer's); the student is its
untrained 1+ELU linear-attention conversion. The metric checks that can fail: a student whose
weights ARE the teacher's must score KL 0 and Spearman 1, and the untrained ELU student must not.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from attn2ssm.adapters import get_adapter
from attn2ssm.eval.attention import (
    METRICS,
    attention_fidelity,
    average_ranks,
    plot_attention_maps,
    spearman,
)
from attn2ssm.student.convert import convert
from tiny_models import make_tokenizer, tiny_model

TEXT = "Call me Ishmael. Some years ago, never mind how long precisely, the quick brown fox jumps."


@pytest.fixture(scope="module")
def pair():
    tok = make_tokenizer()
    teacher = tiny_model("llama", tokenizer=tok)
    student = convert(teacher, ["linear_attention"] * 2, {"linear_attention": {"feature_map": "elu"}}).eval()
    return teacher, student, tok


@pytest.fixture
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, 24))


# ------------------------------------------------------------------------------------ rank statistics
def test_spearman_hand_example_with_ties():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    y = torch.tensor([5.0, 6.0, 7.0, 8.0, 7.0])  # the two 7s tie: they share rank (2 + 3) / 2
    assert average_ranks(y).tolist() == [0.0, 1.0, 2.5, 4.0, 2.5]
    # By hand: rank deviations dx = (-2,-1,0,1,2), dy = (-2,-1,.5,2,.5); ρ = 8 / sqrt(10 · 9.5)
    # (= scipy.stats.spearmanr's 0.8207826816681233).
    assert spearman(x, y).item() == pytest.approx(8 / math.sqrt(95), abs=1e-6)


def test_spearman_monotone_reversed_constant_and_masked():
    x = torch.randn(4, 30)
    assert torch.allclose(spearman(x, torch.exp(3 * x)), torch.ones(4), atol=1e-6)  # any increasing map → 1
    assert torch.allclose(spearman(x, -x), -torch.ones(4), atol=1e-6)
    assert torch.isnan(spearman(x, torch.zeros_like(x))).all()  # a constant row has no correlation
    # Only valid entries count: garbage outside the mask must not change ρ.
    valid = torch.zeros(4, 30, dtype=torch.bool)
    valid[:, :10] = True
    y = torch.exp(x).masked_fill(~valid, 0.0) + torch.randn(4, 30).masked_fill(valid, 0.0) * 100
    assert torch.allclose(spearman(x, y, valid), torch.ones(4), atol=1e-6)


def test_average_ranks_match_a_loop():
    torch.manual_seed(0)
    x = torch.randint(0, 5, (3, 17)).float()  # many ties
    got = average_ranks(x)
    for r in range(3):
        for j in range(17):
            less = (x[r] < x[r, j]).sum().item()
            equal = (x[r] == x[r, j]).sum().item()
            assert got[r, j].item() == pytest.approx(less + (equal - 1) / 2)


# ------------------------------------------------------------------------------------ fidelity
def test_fidelity_keys_and_values(pair, ids):
    teacher, student, _ = pair
    r = attention_fidelity(student, teacher, ids)
    assert [row["layer"] for row in r["layers"]] == [0, 1]
    assert set(r["mean"]) == set(METRICS)
    for row in r["layers"]:
        assert set(METRICS) <= set(row)
        assert row["kl"] > 0.01  # an untrained ELU student is far from softmax: the metric must see it
        assert 0 < row["entropy_teacher"] <= math.log(24) + 1e-5
        assert 0 < row["entropy_student"] <= math.log(24) + 1e-5
        assert -1 <= row["spearman_student"] < 0.99
        assert row["spearman_teacher"] == pytest.approx(1.0, abs=1e-4)  # softmax is monotone in q·k
        assert len(row["kl_per_head"]) == teacher.config.num_attention_heads
        assert row["query_rows"] == 2 * 4 * 24
        assert row["spearman_rows"] == 2 * 4 * (24 - 2)  # rows with ≥ 3 keys
    assert r["mean"]["kl"] == pytest.approx(sum(x["kl"] for x in r["layers"]) / 2)


def test_fidelity_is_zero_when_student_weights_are_the_teachers(pair, ids, monkeypatch):
    teacher, student, _ = pair
    adapter = get_adapter(teacher)
    paths = adapter.attention_module_paths(teacher)
    for i, mixer in student.mixers().items():
        attn = teacher.get_submodule(paths[i])
        monkeypatch.setattr(
            mixer,
            "attention_weights",
            lambda h, pos=None, mask=None, attn=attn: adapter.attention_probs(attn, h, pos, mask),
        )
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in one row
    r = attention_fidelity(student, teacher, ids, mask)
    for row in r["layers"]:
        assert abs(row["kl"]) < 1e-6
        assert row["entropy_student"] == pytest.approx(row["entropy_teacher"], abs=1e-6)
        assert row["spearman_student"] == pytest.approx(1.0, abs=1e-4)
        assert row["query_rows"] == 4 * (2 * 24 - 5)  # padded queries do not count


def test_fidelity_detects_a_scrambled_student(pair, ids, monkeypatch):
    """Weights that are right per row as a set but in the wrong key order: KL > 0, ρ far from 1."""
    teacher, student, _ = pair
    adapter = get_adapter(teacher)
    paths = adapter.attention_module_paths(teacher)

    def reversed_rows(h, pos=None, mask=None, attn=None):
        a = adapter.attention_probs(attn, h, pos, mask)
        length = a.shape[-1]
        idx = torch.arange(length)
        rev = (idx[:, None] - idx[None, :]).clamp_min(0)  # key j of row i takes key i - j's weight
        return torch.gather(a, -1, rev.expand_as(a)).tril()

    for i, mixer in student.mixers().items():
        monkeypatch.setattr(
            mixer,
            "attention_weights",
            lambda h, pos=None, mask=None, attn=teacher.get_submodule(paths[i]): reversed_rows(
                h, pos, mask, attn
            ),
        )
    r = attention_fidelity(student, teacher, ids)
    assert r["mean"]["kl"] > 0.1
    assert r["mean"]["spearman_student"] < 0.5
    # same values per row
    assert r["mean"]["entropy_student"] == pytest.approx(r["mean"]["entropy_teacher"], abs=1e-4)


def test_fidelity_with_padding_is_finite(pair, ids):
    teacher, student, _ = pair
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    r = attention_fidelity(student, teacher, ids, mask)
    assert all(math.isfinite(row[k]) for row in r["layers"] for k in METRICS)
    assert all(row["kl"] >= 0 for row in r["layers"])


# ------------------------------------------------------------------------------------ heat-maps, CLI
def test_heatmaps_written(pair, tmp_path):
    teacher, student, tok = pair
    paths = plot_attention_maps(student, teacher, tok, TEXT, tmp_path, layers=[0, 1], heads=[0, 3])
    assert [p.name for p in paths] == ["attention_maps.png", "attention_maps_log.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_cli_eval_attention(pair, tmp_path, capsys):
    from attn2ssm.cli import main

    teacher, student, tok = pair
    tdir, sdir = tmp_path / "teacher", tmp_path / "student"
    teacher.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    student.save_pretrained(sdir)
    tok.save_pretrained(sdir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join([TEXT] * 80) + "\n")
    argv = [
        "eval",
        str(sdir),
        "--attention",
        "--against",
        str(tdir),
        "--corpus",
        str(corpus),
        "--window",
        "16",
        "--blocks",
        "2",
        "--text",
        TEXT,
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KL(t‖s)" in out and "mean" in out
    data = json.loads((sdir / "eval" / "attention_fidelity.json").read_text())
    assert data["heldout"]["blocks"] == 2 and len(data["heldout"]["layers"]) == 2
    assert data["text"]["layers"][0]["kl"] > 0
    assert all((sdir / "eval" / name).exists() for name in ("attention_maps.png", "attention_maps_log.png"))
    # A teacher is not a student.
    assert (
        main(["eval", str(tdir), "--attention", "--against", str(tdir), "--blocks", "0", "--text", TEXT]) == 2
    )
    assert "not a student" in capsys.readouterr().err
