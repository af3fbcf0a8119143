"""``attn2ssm eval`` on the converted tiny hybrid: perplexity printed; a damaged student, a corpus
without held-out text, a bad window or a folder without a model is one line.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, assert_past_positions_error, result_of


def test_eval_prints_perplexity(slow):
    r = result_of(slow, "eval")
    assert r.returncode == 0, r.stderr
    assert "held-out perplexity" in r.stdout
    model_line = next(line for line in r.stdout.splitlines() if line.strip().startswith("model"))
    ppl = float(model_line.split()[1])
    assert ppl > 1.0 and math.isfinite(ppl)  # a random model scored on real held-out tokens


def test_eval_of_a_student_with_a_truncated_weights_file(slow):
    damaged = Path(slow["student_dir"]).parent / "damaged-student"
    assert_one_line_error(
        result_of(slow, "eval_damaged"), str(damaged / "model.safetensors"), "damaged or incomplete"
    )
    # nothing added
    assert sorted(p.name for p in damaged.iterdir()) == sorted(
        p.name for p in Path(slow["student_dir"]).iterdir()
    )
    assert (damaged / "model.safetensors").stat().st_size == 10_000


def test_eval_refuses_a_corpus_without_held_out_text(slow, ws, capsys):
    """In-process (the model is already built): no held-out tokens is an error, not 'perplexity 1.00'."""
    from attn2ssm.cli import main
    from attn2ssm.data import load_documents, split_documents

    train, heldout = split_documents(load_documents(str(ws.one_paragraph)), str(ws.one_paragraph))
    assert train and not heldout, "precondition: this corpus must have no held-out text"
    assert result_of(slow, "convert").returncode == 0
    assert main(["eval", str(slow["student_dir"]), "--corpus", str(ws.one_paragraph), "--window", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no held-out text" in err[0], err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--window", "1"], "--window 1 is too short"),
        (["--window", "16", "--stride", "40"], "--stride 40 is outside 1..16"),
    ],
)
def test_eval_window_checks(flags, needle, capsys):
    """In-process: checked before the model is even looked for."""
    from attn2ssm.cli import main

    assert main(["eval", "/nope/model", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_eval_of_a_folder_without_a_model(tmp_path, capsys):
    """In-process: eval / generate name what is missing, not --teacher."""
    from attn2ssm.cli import main

    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: {tmp_path} holds no model: config.json is missing — pass a student directory"
    ), err
    assert "--teacher" not in err[0]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["eval", "STUDENT", "--window", "100"],
            ("--window 100 is longer than", "at most 64", "use --window 64 or less"),
        ),
        (["eval", "STUDENT", "--against", "LLAMA", "--window", "100"], ("--window 100",)),
    ],
)
def test_eval_window_past_the_models_positions_is_one_line(slow, ws, capsys, argv, needles):
    """The window must fit the kept attention layer's 64 positions (the student's and, with
    ``--against``, the teacher's)."""
    assert_past_positions_error(slow, ws, capsys, argv, needles)
