"""The length curve (attn2ssm.eval.length_curve): its ratios are the perplexities scored apart, its
mean is the geometric one, and the suite and the report write it (with the suite's kv_fraction)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attn2ssm.eval.length_curve import build_curve, fit_windows, format_curve, score_length_curve
from attn2ssm.eval.perplexity import perplexity
from attn2ssm.eval.suite_settings import SuiteSettings
from tiny_models import make_tokenizer, one_line_error, tiny_model, write_sentence_corpus


def test_build_curve_by_hand():
    teacher = {"a": {16: 10.0, 32: 8.0}, "b": {16: 40.0, 32: 32.0, 64: 30.0}}
    student = {"a": {16: 12.0, 32: 16.0}, "b": {16: 40.0, 32: 64.0, 64: 90.0}}
    curve = build_curve((64, 32, 16), teacher, student)
    assert curve["windows"] == [16, 32]  # 64 lacks corpus a
    assert curve["corpora"]["a"]["ratio"] == pytest.approx([1.2, 2.0])
    assert curve["corpora"]["b"]["ratio"] == pytest.approx([1.0, 2.0])
    assert curve["mean"]["teacher"] == pytest.approx([20.0, 16.0])  # sqrt(10·40), sqrt(8·32)
    assert curve["mean"]["ratio"] == pytest.approx([math.sqrt(1.2), 2.0])
    assert "geometric" in curve["average"]
    table = format_curve(curve)
    assert table[0] == "| student / teacher perplexity | @16 | @32 |" and table[2] == "| a | 1.20× | 2.00× |"
    assert build_curve((16,), teacher, student) is None  # one point is no curve
    assert fit_windows((8192, 512, 1024), 1024) == (512, 1024) and fit_windows((2, 1), None) == (1, 2)


@pytest.fixture(scope="module")
def tiny_pair():
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    teacher = tiny_model("llama", tokenizer=make_tokenizer(), max_positions=64)
    student = convert(teacher, make_plan(2, "linear_attention", keep_attention=[0]))
    return teacher, student


def test_the_curves_ratios_are_the_perplexities_scored_apart(tiny_pair):
    teacher, student = tiny_pair
    g = torch.Generator().manual_seed(1)
    ids = {"x": torch.randint(0, 256, (200,), generator=g), "y": torch.randint(0, 256, (150,), generator=g)}
    curve = score_length_curve(teacher, student, ids, (16, 32, 64))
    assert curve["windows"] == [16, 32, 64]
    for corpus, stream in ids.items():
        for i, w in enumerate((16, 32, 64)):
            t = perplexity(teacher, stream, window=w, stride=w // 2)["ppl"]
            s = perplexity(student, stream, window=w, stride=w // 2)["ppl"]
            assert curve["corpora"][corpus]["teacher"][i] == pytest.approx(t, rel=1e-6)
            assert curve["corpora"][corpus]["ratio"][i] == pytest.approx(s / t, rel=1e-6)
    # a window longer than the shortest corpus is skipped for every corpus
    assert score_length_curve(teacher, student, ids, (16, 32, 160))["windows"] == [16, 32]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_pair):
    teacher, student = tiny_pair
    root = tmp_path_factory.mktemp("curve")
    tok = make_tokenizer()
    for name, model in (("teacher", teacher), ("student", student)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root, write_sentence_corpus(root / "corpus")


def test_the_suite_writes_the_curve_and_the_kv_fraction(saved, tmp_path, capsys):
    from attn2ssm.eval.suite import run_suite

    root, corpus = saved
    settings = SuiteSettings(
        name="tiny",
        corpora=(str(corpus),),
        windows=(32,),
        curve_windows=(16, 32, 64, 128),  # 128: past the models' 64 positions, dropped
        max_tokens=300,
        niah_forms=(),
    )
    report = run_suite(
        str(root / "student"),
        str(root / "teacher"),
        tmp_path / "out",
        settings,
        tmp_path / "c",
        progress=False,
    )
    assert "curve-windows 128 skipped" in capsys.readouterr().err
    saved_json = json.loads((tmp_path / "out" / "suite.json").read_text())
    curve = saved_json["length_curve"]
    assert curve["windows"] == [16, 32, 64]
    by = {r["id"]: r for r in report["rows"]}
    for i, w in enumerate(curve["windows"]):  # the curve is the suite's own perplexity units
        row = by[f"ppl/{corpus}/{w}"]
        assert curve["corpora"][str(corpus)]["ratio"][i] == pytest.approx(row["student"] / row["teacher"])
    assert saved_json["kv_fraction"] == pytest.approx(0.5)  # 1 of 2 layers kept
    assert saved_json["kv_cache"]["teacher_kv_bytes"] == 2 * 2 * 2 * 16 * 8192 * 4
    md = (tmp_path / "out" / "suite.md").read_text()
    assert "| student / teacher perplexity | @16 | @32 | @64 |" in md and "kv_fraction 0.500" in md


def test_the_report_scores_the_curve_at_curve_windows(saved, tmp_path, capsys):
    from attn2ssm.cli import main

    root, corpus = saved
    argv = [
        "eval",
        str(root / "student"),
        "--report",
        "--against",
        str(root / "teacher"),
        "--corpus",
        str(corpus),
    ]
    argv += ["--agreement-prompts", "0", "--blocks", "0", "--window", "32", "--max-tokens", "300"]
    assert main([*argv, "--curve-windows", "16,64,128", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr()
    assert (
        "curve windows 128 skipped" in out.err and "| student / teacher perplexity | @16 | @64 |" in out.out
    )
    curve = json.loads((tmp_path / "r" / "report.json").read_text())["length_curve"]
    ids_ppl = {r["metric"]: r for r in json.loads((tmp_path / "r" / "report.json").read_text())["rows"]}
    assert curve["windows"] == [16, 64] and len(ids_ppl) == 1
    assert "--curve-windows sets the length curve" in one_line_error(
        capsys, ["eval", str(root / "student"), "--curve-windows", "16,32"]
    )
    assert "at least 16 tokens" in one_line_error(capsys, [*argv, "--curve-windows", "8,32"])


def test_fit_positions_drops_the_suites_own_lengths_and_refuses_the_users():
    from attn2ssm.errors import ConfigError
    from attn2ssm.eval.suite_settings import fit_positions, select_needles, select_perplexity, suite_settings

    std = suite_settings("standard")
    fitted, notes = fit_positions(std, 2048, "gpt")
    assert fitted.windows == (1024, 2048) and fitted.niah_lengths == (1024, 2048)
    assert fitted.curve_windows == (512, 1024, 2048)
    assert notes[0] == "note: gpt reads at most 2048 positions: windows 4096,8192 skipped" and len(notes) == 3
    assert fit_positions(std, 8192, "smollm2") == (std, []) and fit_positions(std, None, "x") == (std, [])
    with pytest.raises(ConfigError, match="lower --windows to 2048 or less"):
        fit_positions(select_perplexity(std, windows=(1024, 4096)), 2048, "gpt")
    with pytest.raises(ConfigError, match="lower --needle-lengths to 2048"):
        fit_positions(select_needles(std, lengths=(4096,)), 2048, "gpt")
    with pytest.raises(
        ConfigError, match="the suite needs 8192 — lower --windows and --needle-lengths to 512"
    ):
        fit_positions(std, 512, "tiny")  # nothing of the suite's own fits: refused too
