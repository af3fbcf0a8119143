"""Targets checked against the suite's rows (``eval --suite standard --targets FILE``): each kind met
and missed on hand-written rows, not measured where rows are absent, malformed files refused in one
line (before any model loads, from the CLI), the suite.json / suite.md section, the shipped files."""

import json
from pathlib import Path

import pytest

from attn2ssm.errors import ConfigError
from attn2ssm.eval.suite_settings import SuiteSettings
from attn2ssm.eval.targets import check_targets, format_targets, load_targets, parse_targets
from tiny_models import one_line_error

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "benchmarks" / "targets"


def ppl_row(corpus: str, window: int, teacher: float, student: float) -> dict:
    rid = f"ppl/{corpus}/{window}"
    return {"id": rid, "teacher": teacher, "student": student, "ratio": student / teacher}


def acc_row(rid: str, teacher: float | None, student: float | None) -> dict:
    return {"id": rid, "teacher": teacher, "student": student, "higher_is_better": True}


def check(entries: list[dict], rows: list[dict], planned=()) -> list[dict]:
    return check_targets(parse_targets({"targets": entries}), rows, planned)


def test_max_ratio_met_and_missed():
    rows = [ppl_row("kjv", 2048, 20.0, 23.0), ppl_row("emails", 2048, 30.0, 33.0)]  # 1.15, 1.10
    target = {"name": "no loss at 2048", "kind": "max_ratio", "rows": "ppl/*/2048", "max": 1.18}
    (met,) = check([target], rows)
    assert met["status"] == "met" and met["max"] == 1.18 and met["rows"] == "ppl/*/2048"
    assert met["measured"] == pytest.approx({"ppl/kjv/2048": 1.15, "ppl/emails/2048": 1.1})
    assert met["reason"] == "all 2 rows ppl/*/2048 hold; closest ppl/kjv/2048: ratio 1.150 ≤ 1.18"
    rows[0] = ppl_row("kjv", 2048, 20.0, 24.6)  # 1.23
    (missed,) = check([target], rows + [ppl_row("kjv", 1024, 20.0, 40.0)])  # 1024 is not matched
    assert missed["status"] == "missed" and set(missed["measured"]) == {"ppl/kjv/2048", "ppl/emails/2048"}
    assert missed["reason"] == "ppl/kjv/2048 ratio 1.230 > 1.18"
    (exact,) = check([{**target, "max": 1.15}], [ppl_row("kjv", 2048, 20.0, 23.0)])
    assert exact["status"] == "met"  # equal to the threshold meets it, whatever the float's last bit


def test_min_student_met_and_missed_in_every_form():
    forms = ("niah_single_1", "niah_single_2", "niah_single_3")
    rows = [acc_row(f"niah/{f}/4096", 1.0, s) for f, s in zip(forms, (0.9, 0.8, 0.95), strict=True)]
    rows += [
        acc_row("niah/niah_single_2/4096/recall", 1.0, 0.1),
        acc_row("niah/niah_single_2/2048", 1.0, 0.0),
    ]
    target = {"name": "needles at 4096", "kind": "min_student", "rows": "niah/*/4096", "min": 0.80}
    (met,) = check([target], rows)
    assert met["status"] == "met" and len(met["measured"]) == 3  # recall and 2048 rows not matched
    assert met["reason"].endswith("closest niah/niah_single_2/4096: student 0.80 ≥ 0.80")
    rows[0]["student"], rows[2]["student"] = 0.0, 0.75
    (missed,) = check([target], rows)
    assert missed["status"] == "missed"
    assert missed["reason"] == "niah/niah_single_1/4096 student 0.00 < 0.80 (and 1 more)"


def test_min_vs_teacher_met_and_missed():
    target = {"name": "form 3", "kind": "min_vs_teacher", "rows": "niah/niah_single_3/4096", "margin": 0.10}
    (met,) = check([target], [acc_row("niah/niah_single_3/4096", 0.85, 0.75)])  # 0.85 - 0.10 in floats
    assert met["status"] == "met"
    assert met["measured"] == {"niah/niah_single_3/4096": {"teacher": 0.85, "student": 0.75}}
    (missed,) = check([target], [acc_row("niah/niah_single_3/4096", 0.6, 0.45)])
    assert missed["status"] == "missed"
    assert missed["reason"] == "niah/niah_single_3/4096 student 0.45 < teacher 0.60 − 0.10"


def test_max_ratio_rise_per_corpus():
    target = {
        "name": "holds to 8192",
        "kind": "max_ratio_rise",
        "from_window": 2048,
        "to_window": 8192,
        "max_rise": 0.03,
    }
    rows = [ppl_row("kjv", 2048, 20.0, 22.0), ppl_row("kjv", 8192, 18.0, 20.3)]  # 1.100 -> 1.128
    rows += [ppl_row("emails", 2048, 30.0, 33.0), ppl_row("emails", 8192, 28.0, 30.0)]  # 1.100 -> 1.071
    (met,) = check([target], rows)
    assert met["status"] == "met" and met["corpora"] == "*" and len(met["measured"]) == 4
    assert met["reason"] == "all 2 corpora hold; closest kjv: ratio 1.128 at 8192 ≤ 1.100 at 2048 + 0.03"
    rows[1] = ppl_row("kjv", 8192, 18.0, 27.0)  # 1.5: a rise of 0.4
    (missed,) = check([target], rows)
    assert (
        missed["status"] == "missed" and missed["reason"] == "kjv ratio 1.500 at 8192 > 1.100 at 2048 + 0.03"
    )
    (emails_only,) = check([{**target, "corpora": "emails"}], rows)
    assert emails_only["status"] == "met" and set(emails_only["measured"]) == {
        "ppl/emails/2048",
        "ppl/emails/8192",
    }


def test_rows_the_run_did_not_score_are_not_measured():
    targets = [
        {"name": "long", "kind": "max_ratio", "rows": "ppl/*/8192", "max": 1.2},
        {"name": "rise", "kind": "max_ratio_rise", "from_window": 2048, "to_window": 8192, "max_rise": 0.03},
        {"name": "needles", "kind": "min_student", "rows": "niah/*/4096", "min": 0.8},
        {"name": "speed", "kind": "elsewhere", "by": "bench generate"},
    ]
    rows = [ppl_row("kjv", 2048, 20.0, 21.0)]
    long, rise, needles, speed = check(targets, rows)
    assert [e["status"] for e in (long, rise, needles, speed)] == ["not measured"] * 4
    assert long["measured"] == {} and long["reason"].startswith(
        "not measured: no row ppl/*/8192 in this run (--rows"
    )
    assert rise["reason"].startswith("not measured: no row ppl/kjv/8192 in this run")
    assert rise["measured"] == pytest.approx({"ppl/kjv/2048": 1.05})
    assert needles["reason"].startswith(
        "not measured: no row niah/*/4096 in this run (--rows, --needle-lengths"
    )
    assert speed["reason"] == "not measured: by bench generate, not by the suite"
    # planned rows not scored yet (a run in progress), or with one side missing: not measured, never met
    planned = ["niah/niah_single_1/4096", "niah/niah_single_2/4096"]
    (half,) = check([targets[2]], [acc_row(planned[0], 1.0, 0.9)], planned)
    assert (
        half["status"] == "not measured"
        and half["reason"] == "not measured: niah/niah_single_2/4096 not scored"
    )
    (no_student,) = check([targets[2]], [acc_row(planned[0], 1.0, None)])
    assert no_student["status"] == "not measured"
    # a row already missed decides, whatever is still to come
    (early,) = check([targets[2]], [acc_row(planned[0], 1.0, 0.1)], planned)
    assert early["status"] == "missed"


@pytest.mark.parametrize(
    "data, says",
    [
        (
            {"targets": [{"name": "a", "kind": "min_ratio", "rows": "ppl/*/2048", "max": 1}]},
            "unknown kind 'min_ratio'",
        ),
        ({"targets": [{"name": "a", "kind": "max_ratio", "rows": "ppl/*/2048"}]}, "misses ['max']"),
        (
            {"targets": [{"name": "a", "kind": "max_ratio", "rows": "ppl/*/2048", "max": "1.2x"}]},
            "max '1.2x' is not a number",
        ),
        (
            {"targets": [{"name": "a", "kind": "max_ratio", "rows": "ppl/*/2048", "max": True}]},
            "max True is not a number",
        ),
        (
            {"targets": [{"name": "a", "kind": "max_ratio", "rows": "niah/*/4096", "max": 1.2}]},
            "rows 'niah/*/4096' can match no row",
        ),
        (
            {"targets": [{"name": "a", "kind": "min_student", "rows": "ppl/*/2048", "min": 0.8}]},
            "rows 'ppl/*/2048' can match no row",
        ),
        (
            {
                "targets": [
                    {"name": "a", "kind": "min_student", "rows": "niah/niah_single_9/4096", "min": 0.8}
                ]
            },
            "can match no row",
        ),
        (
            {"targets": [{"name": "a", "kind": "max_ratio", "rows": "ppl/kjv/long", "max": 1.2}]},
            "can match no row",
        ),
        (
            {"targets": [{"name": "a", "kind": "max_ratio", "rows": "ppl/*/2048", "max": 1.2, "min": 1}]},
            "unknown keys ['min']",
        ),
        (
            {
                "targets": [
                    {
                        "name": "a",
                        "kind": "max_ratio_rise",
                        "from_window": "2k",
                        "to_window": 8192,
                        "max_rise": 0.03,
                    }
                ]
            },
            "from_window '2k' is not a number",
        ),
        ({"targets": [{"name": "a", "kind": "elsewhere", "by": ""}]}, "by '' is not a text"),
        ({"targets": [{"kind": "elsewhere", "by": "bench generate"}]}, "target 1 has no name"),
        (
            {
                "targets": [
                    {"name": "a", "kind": "elsewhere", "by": "x"},
                    {"name": "a", "kind": "elsewhere", "by": "y"},
                ]
            },
            "names ['a'] appear more than once",
        ),
        (
            {"targets": [{"name": "a", "kind": "min_student", "rows": "task/*", "min": float("nan")}]},
            "min nan is not a number",
        ),
        ({"targets": [{"name": "a\nb", "kind": "elsewhere", "by": "x"}]}, "target 1 has no name"),
        ({"targets": []}, "must be a non-empty list"),
        ({"goals": []}, "must hold one key, 'targets'"),
        ([1, 2], "must hold one key, 'targets' (it has list)"),
    ],
)
def test_malformed_targets_are_one_line_errors(data, says):
    with pytest.raises(ConfigError) as err:
        parse_targets(data, "t.yaml")
    assert says in str(err.value) and len(str(err.value).splitlines()) == 1


def test_unreadable_files_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_targets(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets: [name: a\n")
    with pytest.raises(ConfigError, match="is not valid YAML .* at line 2, column 1") as err:
        load_targets(bad)
    assert len(str(err.value).splitlines()) == 1


def test_the_report_and_suite_md_carry_the_targets(tmp_path):
    from attn2ssm.eval.suite import suite_report, write_suite_report

    settings = SuiteSettings(
        name="tiny",
        corpora=("kjv",),
        windows=(2048, 8192),
        niah_forms=("niah_single_3",),
        niah_lengths=(4096,),
    )
    score = {"se": None, "n": 10, "cpu_seconds": 1.0}
    teacher = {"ppl/kjv/2048": {**score, "value": 20.0}, "ppl/kjv/8192": {**score, "value": 18.0}}
    student = {"ppl/kjv/2048": {**score, "value": 22.0}, "ppl/kjv/8192": {**score, "value": 27.0}}
    teacher["niah/niah_single_3/4096"] = {**score, "value": 0.6}  # the student's needle is not scored yet
    targets = parse_targets(
        {
            "targets": [
                {"name": "no loss at 2048", "kind": "max_ratio", "rows": "ppl/*/2048", "max": 1.18},
                {
                    "name": "holds",
                    "kind": "max_ratio_rise",
                    "from_window": 2048,
                    "to_window": 8192,
                    "max_rise": 0.03,
                },
                {
                    "name": "form 3",
                    "kind": "min_vs_teacher",
                    "rows": "niah/niah_single_3/4096",
                    "margin": 0.1,
                },
            ]
        }
    )
    report = suite_report(settings, "teacher", "student", teacher, student, targets=targets)
    assert [(e["name"], e["status"]) for e in report["targets"]] == [
        ("no loss at 2048", "met"),
        ("holds", "missed"),
        ("form 3", "not measured"),
    ]
    assert suite_report(settings, "teacher", "student", teacher, student)["targets"] is None
    write_suite_report(report, tmp_path)
    assert json.loads((tmp_path / "suite.json").read_text())["targets"] == report["targets"]
    md = (tmp_path / "suite.md").read_text()
    assert "Targets (1 met, 1 missed, 1 not measured):" in md
    assert "- **missed** — holds: kjv ratio 1.500 at 8192 > 1.100 at 2048 + 0.03" in md
    assert "- **not measured** — form 3: not measured: niah/niah_single_3/4096 not scored" in md
    assert format_targets(None) == [] and "Targets" not in "\n".join(format_targets([]))


def _no_run(*args, **kwargs):
    raise AssertionError("the suite ran: the targets file was not checked up front")


def test_targets_flag_is_refused_up_front(capsys, tmp_path, monkeypatch):
    from attn2ssm.eval import suite

    monkeypatch.setattr(suite, "run_suite", _no_run)
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets:\n  - {name: a, kind: max_ratio, rows: ppl/*/2048, max: lots}\n")
    model = str(tmp_path / "no-such-student")  # nothing loads: the file is refused first
    err = one_line_error(capsys, ["eval", model, "--suite", "standard", "--targets", str(bad)])
    assert "target 1 (a): max 'lots' is not a number" in err
    err = one_line_error(
        capsys, ["eval", model, "--suite", "standard", "--targets", str(tmp_path / "absent")]
    )
    assert "cannot be read" in err
    assert "--targets checks a run of the suite" in one_line_error(
        capsys, ["eval", model, "--targets", str(bad)]
    )


def test_targets_flag_reaches_the_run(capsys, tmp_path, monkeypatch):
    from attn2ssm.cli import main
    from attn2ssm.eval import suite

    settings = SuiteSettings(name="tiny", corpora=("kjv",), windows=(1024, 4096), niah_forms=())
    t = {
        "ppl/kjv/1024": {"value": 20.0, "se": None, "n": 9},
        "ppl/kjv/4096": {"value": 18.0, "se": None, "n": 9},
    }
    s = {
        "ppl/kjv/1024": {"value": 24.0, "se": None, "n": 9},
        "ppl/kjv/4096": {"value": 22.5, "se": None, "n": 9},
    }
    seen = []

    def fake_run(student, teacher, out, settings_, targets=None, **kwargs):
        seen.append(targets)
        return suite.suite_report(settings, "teacher", student, t, s, targets=targets)

    monkeypatch.setattr(suite, "run_suite", fake_run)
    teacher = tmp_path / "teacher"  # a folder with a config.json: resolved without building a teacher
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")
    argv = ["eval", str(tmp_path / "student"), "--suite", "standard", "--out", str(tmp_path / "out")]
    argv += ["--against", str(teacher)]
    assert main(argv + ["--targets", str(SHIPPED / "quickstart.yaml")]) == 0
    assert [t.kind for t in seen[0]] == ["max_ratio_rise"]
    printed = capsys.readouterr().out
    assert "Targets (1 met):" in printed  # 1.200 at 1024, 1.250 at 4096: a rise of 0.05
    assert "closest kjv: ratio 1.250 at 4096 ≤ 1.200 at 1024 + 0.05" in printed


def test_the_shipped_target_files_parse():
    files = {p.stem: load_targets(p) for p in sorted(SHIPPED.glob("*.yaml"))}
    assert sorted(files) == ["linear_hybrid25", "quickstart", "retrieval_heads"]
    kinds = {name: [t.kind for t in targets] for name, targets in files.items()}
    assert kinds["linear_hybrid25"] == ["min_student", "min_vs_teacher", "max_ratio_rise", "max_ratio"]
    assert kinds["retrieval_heads"] == ["min_student"] * 3 + ["max_ratio", "elsewhere"]
    assert kinds["quickstart"] == ["max_ratio_rise"]
    rise = files["linear_hybrid25"][2].fields
    assert (rise["from_window"], rise["to_window"], rise["max_rise"]) == (2048, 8192, 0.03)
    for path in SHIPPED.glob("*.yaml"):
        assert path.read_text().startswith("# Issue 48's target"), path


def test_a_real_run_writes_its_targets(tmp_path, monkeypatch, capsys):
    """The whole path on a tiny teacher and student: ``eval --suite ... --targets`` scores the rows,
    and suite.json's targets read the same rows' ratios."""
    import torch
    from transformers import AutoModelForCausalLM

    from attn2ssm.cli import main
    from attn2ssm.eval import suite_settings as suite
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan
    from tiny_models import SENTENCES, make_tokenizer, tiny_config

    tok = make_tokenizer()
    cfg = tiny_config("llama")
    cfg.vocab_size, cfg.max_position_embeddings = len(tok), 256
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    student = convert(teacher, make_plan(cfg.num_hidden_layers, "linear_attention", attention_ratio=0.5))
    for name, model in (("teacher", teacher), ("student", student)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"d{i}.txt").write_text(" ".join(SENTENCES[i % 4 :] * 3))
    tiny = SuiteSettings(name="tiny", corpora=("sotu",), windows=(32,), max_tokens=200, niah_forms=())
    monkeypatch.setattr(suite, "suite_settings", lambda name, quick=False: tiny)
    targets = tmp_path / "targets.yaml"
    targets.write_text(
        "targets:\n"
        "  - {name: holds, kind: max_ratio_rise, from_window: 32, to_window: 64, max_rise: 1000}\n"
        "  - {name: longer, kind: max_ratio, rows: ppl/*/128, max: 1.2}\n"
    )
    out = tmp_path / "suite"
    argv = ["eval", str(tmp_path / "student"), "--suite", "standard", "--rows", "perplexity"]
    argv += ["--corpora", str(corpus), "--windows", "32,64", "--against", str(tmp_path / "teacher")]
    argv += ["--out", str(out), "--suite-cache", str(tmp_path / "cache"), "--targets", str(targets)]
    assert main(argv) == 0
    report = json.loads((out / "suite.json").read_text())
    ratios = {r["id"]: r["ratio"] for r in report["rows"]}
    holds, longer = report["targets"]
    assert holds["status"] == "met" and holds["measured"] == pytest.approx(ratios)
    assert set(ratios) == {f"ppl/{corpus}/32", f"ppl/{corpus}/64"}
    assert longer["status"] == "not measured" and longer["measured"] == {}
    assert (
        "- **not measured** — longer: not measured: no row ppl/*/128 in this run" in capsys.readouterr().out
    )
