"""The evaluation suite: each statistic against a hand computation, the anchors' table, and a whole
(shrunk) suite on a tiny teacher and student, the teacher's units cached."""

import json
import math

import pytest
import torch

from attn2ssm.errors import ConfigError
from attn2ssm.eval.stats import binomial_se, items_scored, pooled_accuracy
from attn2ssm.eval.suite import SideCache, pair_rows, plan_units, run_suite, task_samples, unit_key
from attn2ssm.eval.suite_settings import (
    CORE,
    ROW_GROUPS,
    SuiteSettings,
    TaskSpec,
    select_needles,
    select_perplexity,
    select_rows,
    suite_settings,
    with_overrides,
)
from attn2ssm.eval.tables import anchors_table
from tiny_models import make_tokenizer, one_line_error, tiny_model, write_sentence_corpus


def test_binomial_se_hand_cases():
    assert binomial_se(0.5, 400) == pytest.approx(0.025)  # the suite's 400 items: 2.5 points at p = 0.5
    assert binomial_se(0.25, 399) == pytest.approx(math.sqrt(0.1875 / 399))  # MMLU, 7 per subject
    assert binomial_se(1.0, 5) == 0.0 and binomial_se(0.0, 20) == 0.0
    with pytest.raises(ValueError, match="n >= 1"):
        binomial_se(0.5, 0)
    with pytest.raises(ValueError, match="0 <= p <= 1"):
        binomial_se(1.5, 10)


def test_pooled_accuracy_weights_tasks_by_items():
    record = {
        "results": {"a": {"acc,none": 0.5}, "b": {"acc,none": 1.0}, "g": {"acc,none": 0.875}},
        "n-samples": {"a": {"effective": 2}, "b": {"effective": 6}},
        "group_subtasks": {"g": ["a", "b"]},
    }
    assert pooled_accuracy(record, "acc") == (pytest.approx((0.5 * 2 + 1.0 * 6) / 8), 8)
    assert (
        items_scored(record, "g") == 8
        and items_scored(record, "a") == 2
        and items_scored(record, "zz") is None
    )
    gen = {"results": {"t": {"exact_match,remove_whitespace": 0.25}}, "n-samples": {"t": {"effective": 4}}}
    assert pooled_accuracy(gen, "exact_match") == (0.25, 4)
    from attn2ssm.errors import ConfigError

    with pytest.raises(ConfigError, match="no acc_norm for a"):
        pooled_accuracy(record, "acc_norm")


def test_standard_and_quick_settings_meet_their_standard_errors():
    std, quick = suite_settings("standard"), suite_settings("standard", quick=True)
    for spec in std.tasks:
        n = spec.items * (57 if spec.task == "mmlu" else 1)
        assert binomial_se(0.5, n) <= 0.0251, spec
    assert [t.shots for t in std.tasks if t.task == "mmlu"] == [0, 5] and std.generation.task == "triviaqa"
    assert std.generation.shots == quick.generation.shots == 5  # 0-shot, the instruct teacher answers nothing
    assert std.niah_trials >= 20 and std.niah_lengths == std.windows == (1024, 2048, 4096, 8192)
    assert std.curve_windows == (512, 1024, 2048, 4096, 8192) and std.max_tokens >= 2 * 8192
    # --quick: its 4,096 tokens a corpus hold no longer window; 8k needles would double its cost
    assert quick.windows == (1024, 2048) and quick.curve_windows == (512, 1024, 2048, 4096)
    assert quick.niah_lengths == (1024, 2048, 4096) and max(quick.curve_windows) <= quick.max_tokens
    assert set(std.corpora) >= {"emails", "kjv", "pydoc", "sotu", "moby-dick"}
    assert (
        quick.max_tokens < std.max_tokens
        and quick.niah_trials < std.niah_trials
        and all(q.items < s.items for q, s in zip(quick.tasks, std.tasks))
    )
    from attn2ssm.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown suite"):
        suite_settings("huge")


def test_task_samples_are_a_fixed_random_subset(monkeypatch):
    from attn2ssm.eval import harness, suite

    monkeypatch.setattr(harness, "doc_counts", lambda name: {"x_1": 10, "x_2": 3})
    suite._doc_counts.cache_clear()
    a = task_samples(TaskSpec("x", items=4), seed=1)
    assert a == task_samples(TaskSpec("x", items=4), seed=1) and a != task_samples(
        TaskSpec("x", items=4), seed=2
    )
    assert len(a["x_1"]) == 4 and a["x_1"] == sorted(set(a["x_1"])) and all(0 <= i < 10 for i in a["x_1"])
    assert a["x_2"] == [0, 1, 2]  # fewer documents than items: all of them
    assert task_samples(TaskSpec("x"), seed=1) is None
    suite._doc_counts.cache_clear()


def test_model_identity_changes_with_the_weights_not_with_eval_outputs(tmp_path):
    import os

    from attn2ssm.eval.suite import model_identity

    assert model_identity("smollm2-135m") == "smollm2-135m"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    first = model_identity(str(tmp_path))
    (tmp_path / "eval" / "suite").mkdir(parents=True)
    (tmp_path / "eval" / "suite" / "suite.json").write_text("{}")
    assert model_identity(str(tmp_path)) == first
    (tmp_path / "model.safetensors").write_bytes(b"xy")
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    assert model_identity(str(tmp_path)) != first


def _settings(**kw) -> SuiteSettings:
    base = SuiteSettings(
        name="t",
        corpora=("c",),
        windows=(8,),
        tasks=(TaskSpec("arc_easy", "acc", 0, 4, "ARC-e"), TaskSpec("mmlu", "acc", 5, 1, "MMLU 5-shot")),
        generation=TaskSpec("triviaqa", "exact_match", 0, 4, "TQA"),
        niah_forms=("niah_single_1",),
        niah_lengths=(100,),
        niah_trials=4,
    )
    return with_overrides(base, **kw)


def test_pair_rows_and_the_anchors_table_by_hand():
    s = _settings()
    teacher = {
        "ppl/c/8": {"value": 10.0, "se": None, "n": 50, "cpu_seconds": 3.0, "cached": True},
        "task/arc_easy/0": {"value": 0.5, "se": 0.25, "n": 4, "cpu_seconds": 1.0},
        "task/mmlu/5": {"value": 0.25, "se": 0.1, "n": 57, "cpu_seconds": 2.0},
        "task/triviaqa/0": {"value": 0.5, "se": 0.25, "n": 4, "cpu_seconds": 1.0},
        "niah/niah_single_1/100": {"value": 1.0, "se": 0.0, "n": 4, "cpu_seconds": 5.0},
        "niah/niah_single_1/100/recall": {"value": 1.0, "se": 0.0, "n": 4, "cpu_seconds": 0.0},
    }
    student = {k: {**v, "value": v["value"] / 2, "cached": False} for k, v in teacher.items()}
    student["ppl/c/8"]["value"] = 12.5
    rows = pair_rows(s, teacher, student)
    by = {r["id"]: r for r in rows}
    ppl = by["ppl/c/8"]
    assert (
        ppl["recovered"] == pytest.approx(10 / 12.5)
        and ppl["ratio"] == pytest.approx(1.25)
        and ppl["n"] == 50
    )
    assert ppl["cpu_seconds"] == {"teacher": None, "student": 3.0}  # the teacher's came from the cache
    assert (
        by["task/arc_easy/0"]["recovered"] == pytest.approx(0.5)
        and by["task/arc_easy/0"]["teacher_se"] == 0.25
    )
    assert [r["id"] for r in rows] == list(teacher)  # table order: perplexity, tasks, generation, needles
    from attn2ssm.eval.tables import format_table

    assert "| perplexity c | ppl @8 | 10 | 12.5 | 80.0 % (1.25×) | 50 | cached / 3 |" in format_table(rows)
    assert "| arc_easy (0-shot) | acc | 50.0 ± 25.0 | 25.0 ± 25.0 | 50.0 % | 4 | 1 / 1 |" in format_table(
        rows
    )
    table = anchors_table(rows, s)
    assert table[0] == "| model | ARC-e | avg (core) | MMLU 5-shot | TQA | NIAH-1 @100 |"
    assert table[2] == "| teacher | 50.0 | 50.0 | 25.0 | 50.0 | 100.0 |"
    assert table[3] == "| student | 25.0 | 25.0 | 12.5 | 25.0 | 50.0 |"
    assert table[4] == "| recovered | 50 % | 50 % | 50 % | 50 % | 50 % |"


def test_side_cache_keeps_units_by_key(tmp_path):
    cache = SideCache(tmp_path, "teacher-x")
    assert cache.get({"unit": "a"}) is None
    cache.put({"unit": "a"}, {"a": {"value": 1.0}})
    again = SideCache(tmp_path, "teacher-x")
    assert again.get({"unit": "a"}) == {"a": {"value": 1.0}} and again.get({"unit": "b"}) is None
    assert SideCache(tmp_path, "teacher-y").get({"unit": "a"}) is None


def test_a_gpu_s_teacher_units_are_cached_apart(tmp_path):
    """The CPU's cache keeps its name (the units already scored stay found); a GPU's is another."""
    from attn2ssm.eval.suite import teacher_cache

    cpu = teacher_cache(tmp_path, "teacher-x")
    assert cpu.path == SideCache(tmp_path, "teacher-x").path
    assert teacher_cache(tmp_path, "teacher-x", torch.device("cpu")).path == cpu.path
    cuda = teacher_cache(tmp_path, "teacher-x", torch.device("cuda", 1))
    assert cuda.path != cpu.path and cuda.path == teacher_cache(tmp_path, "teacher-x", "cuda").path


# ------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pytest.importorskip("lm_eval", reason="needs lm_eval (pip install -e '.[eval]')")
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    root = tmp_path_factory.mktemp("suite")
    tok = make_tokenizer()
    teacher = tiny_model("llama", tokenizer=tok, max_positions=1024)
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    student = convert(
        teacher, make_plan(teacher.config.num_hidden_layers, "linear_attention", attention_ratio=0.5)
    )
    student.save_pretrained(root / "student")
    tok.save_pretrained(root / "student")
    return root, write_sentence_corpus(root / "corpus")


def test_run_suite_writes_the_table_and_caches_the_teacher(pair, tmp_path):
    root, corpus = pair
    settings = SuiteSettings(
        name="tiny",
        corpora=(str(corpus),),
        windows=(32, 64),
        max_tokens=400,
        tasks=(TaskSpec("arc_easy", "acc", 0, 3, "ARC-e"), TaskSpec("mmlu_anatomy", "acc", 1, 2, "MMLU")),
        generation=TaskSpec("triviaqa", "exact_match", 0, 2, "TQA"),
        max_gen_toks=4,
        niah_forms=("niah_single_1", "niah_single_3"),
        niah_lengths=(400,),
        niah_trials=2,
        niah_essay=str(corpus),
        batch_size=2,
    )
    report = run_suite(
        str(root / "student"),
        str(root / "teacher"),
        tmp_path / "out",
        settings,
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    ids = [r["id"] for r in report["rows"]]
    assert ids == [
        f"ppl/{corpus}/32",
        f"ppl/{corpus}/64",
        "task/arc_easy/0",
        "task/mmlu_anatomy/1",
        "task/triviaqa/0",
        "niah/niah_single_1/400",
        "niah/niah_single_1/400/recall",
        "niah/niah_single_3/400",
        "niah/niah_single_3/400/recall",
    ]
    by = {r["id"]: r for r in report["rows"]}
    assert (
        by["task/arc_easy/0"]["n"] == 3
        and by["task/mmlu_anatomy/1"]["n"] == 2
        and by["niah/niah_single_3/400"]["n"] == 2
    )
    for r in report["rows"]:
        if not r["id"].startswith("ppl/"):
            p = r["student"]
            assert r["student_se"] == pytest.approx(math.sqrt(p * (1 - p) / r["n"]))
        assert r["cpu_seconds"]["teacher"] is not None and r["cpu_seconds"]["student"] is not None
    for name in ("suite.json", "suite.md", "suite.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    md = (tmp_path / "out" / "suite.md").read_text()
    assert (
        "| model | ARC-e | avg (core) | MMLU | TQA | NIAH-1 @400 | NIAH-3 @400 |" in md
        and "CPU s (teacher / student)" in md
    )
    arc = by["task/arc_easy/0"]
    # accuracies in %, ± SE in points
    assert f"| {100 * arc['teacher']:.1f} ± {100 * arc['teacher_se']:.1f} |" in md
    assert json.loads((tmp_path / "out" / "suite.json").read_text())["rows"] == json.loads(
        json.dumps(report["rows"])
    )
    # the teacher again: every unit from the cache, the same numbers
    again = run_suite(
        str(root / "student"),
        str(root / "teacher"),
        tmp_path / "out2",
        settings,
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    assert all(r["cpu_seconds"]["teacher"] is None for r in again["rows"])
    assert [r["teacher"] for r in again["rows"]] == [r["teacher"] for r in report["rows"]]
    assert [r["student"] for r in again["rows"]] == pytest.approx([r["student"] for r in report["rows"]])
    assert len(plan_units(settings)) == 2 + 3 + 2


def test_suite_flags_are_one_line_errors(capsys, tmp_path):
    assert "--quick is a form of the suite" in one_line_error(capsys, ["eval", str(tmp_path), "--quick"])
    assert "unknown suite 'huge'" in one_line_error(capsys, ["eval", str(tmp_path), "--suite", "huge"])
    assert "different evaluations" in one_line_error(
        capsys, ["eval", str(tmp_path), "--suite", "standard", "--report"]
    )


def test_select_rows_keeps_the_named_groups_and_their_units():
    full = suite_settings("standard", quick=True)
    ids = {u.id for u in plan_units(full)}
    ppl = select_rows(full, "perplexity")
    # 5 corpora × the rows' windows 1024, 2048 and the curve's 512 and 4096
    assert [u.kind for u in plan_units(ppl)] == ["ppl"] * 20
    assert [u.params[1] for u in plan_units(ppl)][:4] == [512, 1024, 2048, 4096]
    mmlu_needles = select_rows(full, "mmlu, needles")
    assert {u.id for u in plan_units(mmlu_needles)} == {
        "task/mmlu/0",
        "task/mmlu/5",
        *(f"niah/{f}/{n}" for f in full.niah_forms for n in full.niah_lengths),
    }
    core = select_rows(full, "tasks,generation")
    assert [u.params[0].task for u in plan_units(core)] == [t for t, _, _ in CORE] + ["triviaqa"]
    everything = select_rows(full, ",".join(ROW_GROUPS))
    assert {u.id for u in plan_units(everything)} == ids  # same ids: the teacher's cache is shared
    assert select_rows(full, None) is full
    with pytest.raises(ConfigError, match="unknown ones \\['ppl'\\]"):
        select_rows(full, "ppl")


def test_rows_flag_is_a_one_line_error(capsys, tmp_path):
    assert "--rows chooses rows of the suite" in one_line_error(
        capsys, ["eval", str(tmp_path), "--rows", "perplexity"]
    )
    assert "unknown ones ['bogus']" in one_line_error(
        capsys, ["eval", str(tmp_path), "--suite", "standard", "--rows", "bogus"]
    )


def test_select_needles_sets_lengths_and_trials_and_keeps_shared_units_keys():
    full = suite_settings("standard")
    short = select_needles(full, lengths=(2048, 1024, 1024))
    assert short.niah_lengths == (1024, 2048) and short.niah_trials == 20
    assert [u.id for u in plan_units(short) if u.kind == "niah"] == [
        f"niah/{f}/{n}" for f in full.niah_forms for n in (1024, 2048)
    ]
    inputs = {"essay_sha": "e"}
    shared = next(u for u in plan_units(full) if u.id == "niah/niah_single_2/1024")
    assert unit_key(shared, short, inputs) == unit_key(shared, full, inputs)  # the 1k unit is cached once
    more = select_needles(suite_settings("standard", quick=True), trials=20)
    assert more.niah_trials == 20 and more.niah_lengths == (1024, 2048, 4096) and not more.chosen
    assert short.chosen == ("--needle-lengths",)
    assert unit_key(shared, more, inputs)["trials"] == 20
    assert unit_key(shared, suite_settings("standard", quick=True), inputs)["trials"] == 5
    assert select_needles(full) == full
    with pytest.raises(ConfigError, match="at least 256 tokens"):
        select_needles(full, lengths=(128, 1024))
    with pytest.raises(ConfigError, match="not a count of trials"):
        select_needles(full, trials=0)


def test_select_perplexity_sets_corpora_and_windows_and_keeps_shared_units_keys():
    full = suite_settings("standard", quick=True)
    demo = select_perplexity(full, corpora=("emails", " kjv", "pydoc", "kjv"), windows=(1024,))
    assert demo.corpora == ("emails", "kjv", "pydoc") and demo.windows == (1024,)
    assert [u.id for u in plan_units(demo) if u.kind == "ppl"] == [
        "ppl/emails/1024",
        "ppl/kjv/1024",
        "ppl/pydoc/1024",
    ]
    inputs = {"ids_sha": {"emails": "abc"}}
    shared = next(u for u in plan_units(full) if u.id == "ppl/emails/1024")
    assert unit_key(shared, demo, inputs) == unit_key(shared, full, inputs)  # the demo's rows are cached once
    assert select_perplexity(full, windows=(2048, 1024, 2048)).windows == (1024, 2048)
    # --windows alone: the curve over those windows; --curve-windows sets the curve's own
    assert demo.curve_windows == () and demo.perplexity_windows == (1024,) and demo.chosen == ("--windows",)
    both = select_perplexity(full, windows=(1024,), curve=(4096, 1024))
    assert both.curve_windows == (1024, 4096) and both.perplexity_windows == (1024, 4096)
    assert select_perplexity(full, curve=(1024, 2048)).windows == full.windows
    assert select_perplexity(full) == full
    with pytest.raises(ConfigError, match="names no corpus"):
        select_perplexity(full, corpora=(" ", ""))
    with pytest.raises(ConfigError, match="at least 16 tokens"):
        select_perplexity(full, windows=(8, 1024))


def test_perplexity_flags_are_one_line_errors(capsys, tmp_path):
    assert "--windows chooses rows of the suite" in one_line_error(
        capsys, ["eval", str(tmp_path), "--windows", "1024"]
    )
    assert "--corpora chooses rows of the suite" in one_line_error(
        capsys, ["eval", str(tmp_path), "--corpora", "kjv"]
    )
    assert "--windows 'x' is not a comma-separated list" in one_line_error(
        capsys, ["eval", str(tmp_path), "--suite", "standard", "--windows", "x"]
    )
    assert "at least 16 tokens" in one_line_error(
        capsys, ["eval", str(tmp_path), "--suite", "standard", "--windows", "8"]
    )


def test_needle_flags_with_the_suite_are_one_line_errors(capsys, tmp_path):
    assert "at least 256 tokens" in one_line_error(
        capsys, ["eval", str(tmp_path), "--suite", "standard", "--needle-lengths", "100"]
    )
    assert "--needle-trials 0 is not a count" in one_line_error(
        capsys, ["eval", str(tmp_path), "--suite", "standard", "--needle-trials", "0"]
    )


@pytest.mark.slow
def test_the_real_teacher_against_itself_recovers_everything(tmp_path):
    """The built-in teacher as its own student on a shrunk suite (the real corpora, tasks and needle
    prompts): every row recovers 100 %, and the teacher's scores are what a teacher of its size scores."""
    pytest.importorskip("lm_eval", reason="needs lm_eval (pip install -e '.[eval]')")
    settings = with_overrides(
        suite_settings("standard", quick=True),
        corpora=("kjv", "pydoc", "emails"),
        windows=(1024,),
        max_tokens=2048,
        tasks=(TaskSpec("arc_easy", "acc", 0, 40, "ARC-e"),),
        generation=TaskSpec("triviaqa", "exact_match", 0, 8, "TQA"),
        niah_forms=("niah_single_1", "niah_single_2"),
        niah_lengths=(1024,),
        niah_trials=2,
    )
    report = run_suite(
        "smollm2-135m",
        "smollm2-135m",
        tmp_path / "out",
        settings,
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    for r in report["rows"]:
        if r["teacher"]:
            assert r["recovered"] == pytest.approx(1.0, rel=1e-3), r
    by = {r["id"]: r for r in report["rows"]}
    assert 5 < by["ppl/kjv/1024"]["teacher"] < 200 and by["ppl/pydoc/1024"]["n"] == 2047
    assert 0.3 < by["task/arc_easy/0"]["teacher"] < 0.8  # 0.516 on all 2376 questions


def test_eval_suite_command_prints_and_writes(pair, tiny_suite, tmp_path, capsys):
    """``attn2ssm eval STUDENT --suite standard --quick --against T --out DIR`` (the suite shrunk to tiny sizes)."""
    from attn2ssm.cli import main

    root, corpus = pair
    asked = tiny_suite([corpus])
    out = tmp_path / "suite"
    assert (
        main(
            [
                "eval",
                str(root / "student"),
                "--suite",
                "standard",
                "--quick",
                "--against",
                str(root / "teacher"),
                "--out",
                str(out),
                "--suite-cache",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    assert asked == [("standard", True)]
    printed = capsys.readouterr().out
    assert "| model | PIQA | avg (core) | NIAH-1 @400 |" in printed and f"wrote {out / 'suite.md'}" in printed
    assert json.loads((out / "suite.json").read_text())["suite"] == "standard --quick"


def test_eval_suite_perplexity_rows_alone(pair, tiny_suite, tmp_path, capsys):
    """``make demo``'s table: ``--rows perplexity --corpora ... --windows ...`` scores those rows only
    and prints no (empty) accuracy table."""
    from attn2ssm.cli import main

    root, corpus = pair
    tiny_suite(["sotu"], windows=(32, 64))  # "sotu" is replaced by --corpora: nothing is fetched
    out = tmp_path / "suite"
    argv = ["eval", str(root / "student"), "--suite", "standard", "--quick", "--rows", "perplexity"]
    argv += ["--corpora", str(corpus), "--windows", "64", "--against", str(root / "teacher")]
    assert main(argv + ["--out", str(out), "--suite-cache", str(tmp_path / "cache")]) == 0
    report = json.loads((out / "suite.json").read_text())
    assert [r["id"] for r in report["rows"]] == [f"ppl/{corpus}/64"]
    row = report["rows"][0]
    assert row["teacher"] > 1 and row["student"] > 1 and row["n"] == 199
    printed = capsys.readouterr().out
    assert "Accuracies" not in printed and "| model |" not in printed
    assert f"| perplexity {corpus} | ppl @64 |" in printed
