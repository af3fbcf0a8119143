"""``attn2ssm eval MODEL --branch window|linear|both`` (and ``--suite ... --branch``): a LoLCATs-style
student scored with one branch of its window + linear mixers, checked against the same student with
every mixer's ``branch`` set by hand; a student without a window branch, an unknown branch and
``--branch`` with another evaluation are one-line errors."""

import json

import pytest
import torch

from attn2ssm.eval.perplexity import perplexity
from attn2ssm.mixers.linear_attention import LinearAttentionMixer, set_window_branch
from tiny_models import (
    make_tokenizer,
    one_line_error,
    perturb_new_mixer_parameters,
    tiny_model,
    write_sentence_corpus,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    root = tmp_path_factory.mktemp("branch")
    tok = make_tokenizer()
    teacher = tiny_model("llama", tokenizer=tok, max_positions=256)
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    plan = make_plan(teacher.config.num_hidden_layers, "linear_attention", attention_ratio=0.0)
    for name, options in (
        ("windowed", {"feature_map": "hedgehog", "window": 4}),
        ("plain", {"feature_map": "hedgehog"}),
    ):
        student = convert(teacher, plan, {"linear_attention": options})
        perturb_new_mixer_parameters(student)
        student.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root, write_sentence_corpus(root / "corpus")


def _load(path):
    from attn2ssm.student.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(str(path))


def test_set_window_branch_switches_every_windowed_mixer(models):
    root, _ = models
    student, _ = _load(root / "windowed")
    mixers = [m for m in student.modules() if isinstance(m, LinearAttentionMixer)]
    assert mixers and all(m.branch == "both" for m in mixers)
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = student(input_ids=ids).logits
        assert set_window_branch(student, "linear") == len(mixers)
        assert all(m.branch == "linear" for m in mixers)
        linear = student(input_ids=ids).logits
        set_window_branch(student, "both")
        # switched back: the student as trained
        torch.testing.assert_close(student(input_ids=ids).logits, full)
    assert not torch.allclose(linear, full)


@pytest.mark.parametrize("branch", ["window", "linear"])
def test_eval_branch_scores_the_student_with_that_branch_alone(models, tmp_path, branch):
    """The CLI's perplexity with --branch equals the perplexity of the student whose mixers were
    switched by hand (mixer.branch), and differs from the whole student's."""
    from attn2ssm.cli import main
    from attn2ssm.data import prepare_corpus

    root, corpus = models
    out = tmp_path / "ppl.json"
    assert (
        main(
            [
                "eval",
                str(root / "windowed"),
                "--corpus",
                str(corpus),
                "--window",
                "32",
                "--max-tokens",
                "300",
                "--branch",
                branch,
                "--json",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())["model"]
    assert got["branch"] == branch
    student, tok = _load(root / "windowed")
    held = prepare_corpus(str(corpus), tok, max_heldout_tokens=300, max_train_tokens=0).heldout_ids
    whole = perplexity(student, held, window=32, max_tokens=300, progress=False)["ppl"]
    for m in student.modules():
        if isinstance(m, LinearAttentionMixer):
            m.branch = branch
    by_hand = perplexity(student, held, window=32, max_tokens=300, progress=False)["ppl"]
    assert got["ppl"] == pytest.approx(by_hand, rel=1e-5)
    assert got["ppl"] != pytest.approx(whole, rel=1e-4)


def test_branch_errors_are_one_line(models, capsys):
    root, corpus = models
    err = one_line_error(
        capsys, ["eval", str(root / "plain"), "--corpus", str(corpus), "--window", "32", "--branch", "window"]
    )
    assert "has no mixer with a softmax window" in err and "window branch" in err
    assert "--branch 'middle' is not a branch" in one_line_error(
        capsys, ["eval", str(root / "windowed"), "--branch", "middle"]
    )
    assert "--branch applies to perplexity and --suite" in one_line_error(
        capsys, ["eval", str(root / "windowed"), "--report", "--branch", "linear"]
    )
    # --branch both on a student without a window is the student as it is: no error
    from attn2ssm.cli import main

    assert (
        main(
            [
                "eval",
                str(root / "plain"),
                "--corpus",
                str(corpus),
                "--window",
                "32",
                "--max-tokens",
                "200",
                "--branch",
                "both",
            ]
        )
        == 0
    )


def test_suite_with_a_branch_writes_its_own_folder(models, tmp_path, monkeypatch, capsys):
    """``eval STUDENT --suite standard --branch linear`` (the suite shrunk to one perplexity row):
    MODEL/eval/suite-linear, the branch in suite.json and the title, the student's row the
    hand-switched student's perplexity; a student without a window: one line, before any scoring."""
    from attn2ssm.cli import main
    from attn2ssm.data import prepare_corpus
    from attn2ssm.eval import suite_settings as suite

    root, corpus = models
    tiny = suite.SuiteSettings(
        name="standard",
        corpora=(str(corpus),),
        windows=(32,),
        max_tokens=200,
        tasks=(),
        generation=None,
        niah_forms=(),
        niah_lengths=(),
        batch_size=2,
    )
    monkeypatch.setattr(suite, "suite_settings", lambda name, quick=False: tiny)
    student_dir = root / "windowed"
    assert (
        main(
            [
                "eval",
                str(student_dir),
                "--suite",
                "standard",
                "--branch",
                "linear",
                "--against",
                str(root / "teacher"),
                "--suite-cache",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    out = student_dir / "eval" / "suite-linear"
    report = json.loads((out / "suite.json").read_text())
    assert report["branch"] == "linear" and "(linear branch only)" in (out / "suite.md").read_text()
    student, tok = _load(student_dir)
    set_window_branch(student, "linear")
    held = prepare_corpus(str(corpus), tok, max_heldout_tokens=200, max_train_tokens=0).heldout_ids[:200]
    expect = perplexity(student, held, window=32, stride=16, batch_size=128, progress=False)["ppl"]
    assert report["rows"][0]["student"] == pytest.approx(expect, rel=1e-5)
    err = one_line_error(
        capsys,
        [
            "eval",
            str(root / "plain"),
            "--suite",
            "standard",
            "--branch",
            "linear",
            "--against",
            str(root / "teacher"),
            "--out",
            str(tmp_path / "x"),
            "--suite-cache",
            str(tmp_path / "cache"),
        ],
    )
    assert "has no mixer with a softmax window" in err and not (tmp_path / "x").exists()
