"""``attn2ssm generate`` on the converted tiny hybrid: it generates, with a draft it decodes
speculatively; a missing folder and settings out of range are one line.
"""

from __future__ import annotations

import pytest
from cli_run import assert_one_line_error, assert_past_positions_error, result_of


def test_generate_from_a_folder_that_does_not_exist(slow):
    """A relative path with one slash could be a hub id: the error says there is no such folder, and what a hub id needs."""
    line = assert_one_line_error(
        result_of(slow, "generate_no_folder"),
        "there is no local folder 'runs/no-such-run-attn2ssm-test'",
        "a hub id needs the network",
    )
    assert not line.startswith("error: could not load the teacher's tokenizer")


def test_generate_runs(slow):
    r = result_of(slow, "generate")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert not any(line.startswith("error:") for line in r.stderr.splitlines()), r.stderr


def test_generate_with_a_draft_reports_acceptance(slow):
    """`generate --draft` (the teacher drafting for its student) decodes speculatively and says how it went."""
    r = result_of(slow, "generate_draft")
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if line.startswith("[speculative]")]
    assert len(stats) == 1 and "acceptance" in stats[0] and "tokens in" in stats[0], r.stderr


def test_generate_bad_draft_count_is_one_line(capsys):
    from attn2ssm.cli import main

    assert (
        main(
            ["generate", "/nope/model", "--draft", "/nope/draft", "--prompt", "x", "--num-draft-tokens", "0"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-draft-tokens 0" in err[0], err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["--max-new-tokens", "-5"], "--max-new-tokens -5"),
        (["--temperature", "1", "--top-p", "2"], "--top-p 2.0 is outside (0, 1]"),
        (["--temperature", "1", "--top-p", "0"], "--top-p 0.0"),
        (["--temperature", "-1"], "--temperature -1.0"),
        (["--temperature", "nan"], "--temperature nan"),
        (["--top-k", "-1"], "--top-k -1"),
    ],
)
def test_generate_settings_out_of_range_are_one_line(flags, needle, capsys):
    """In-process: checked before the model is even looked for (no silent greedy for a negative temperature)."""
    from attn2ssm.cli import main

    assert main(["generate", "/nope/model", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0] and " — " in err[0], err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["generate", "STUDENT", "--prompt", "Call me Ishmael. " * 20, "--max-new-tokens", "5"],
            ("positions; ", "reads at most 64", "shorten the prompt to fewer than 64"),
        ),
        (
            ["generate", "STUDENT", "--prompt", "Call me", "--max-new-tokens", "100"],
            ("reads at most 64", "lower --max-new-tokens to"),
        ),
        (
            ["generate", "STUDENT", "--prompt", "Call me", "--draft", "LLAMA", "--max-new-tokens", "100"],
            ("reads at most 64",),
        ),
    ],
)
def test_generate_past_the_models_positions_is_one_line(slow, ws, capsys, argv, needles):
    """The prompt and the new tokens must fit the kept attention layer's 64 positions."""
    assert_past_positions_error(slow, ws, capsys, argv, needles)
