"""``attn2ssm bench generate --spec`` on a tiny teacher: every speculative run's tokens equal the
target's plain greedy decode, the copy task's prompt holds the passage it asks to repeat, the
JSON and PNG are written, and bad flags are one-line errors."""

import json

import pytest
import torch

from attn2ssm.bench.generate import COPY_PRIMER, copy_prompt, measure_speculative
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from tiny_models import SENTENCES, make_tokenizer, save_tiny_teacher_and_corpus, tiny_model


def test_measure_speculative_is_identical_to_plain():
    teacher = tiny_model("llama", layers=4)
    target = convert(teacher, make_plan(4, "mamba2", attention_ratio=0.25)).eval()
    draft = convert(teacher, make_plan(2, "mamba2"), depth=2).eval()
    g = torch.Generator().manual_seed(0)
    p = torch.randint(1, 256, (1, 10), generator=g)
    prompt = torch.cat([p, p, p[:, :3]], 1)  # something for lookup to find
    out = measure_speculative(
        target, {"ngram": "ngram", "shallow": draft}, prompt, [1, 3], new_tokens=10, rounds=2
    )
    assert set(out["by_drafter"]) == {"ngram", "shallow"} and len(out["plain_seconds_all"]) == 2
    for rows in out["by_drafter"].values():
        assert [r["k"] for r in rows] == [1, 3]
        assert all(
            r["identical_to_plain_greedy"] and r["generated"] == 10 and len(r["seconds_all"]) == 2
            for r in rows
        )
        assert all(r["speedup"] > 0 and r["tokens_per_target_forward"] >= 1 for r in rows)
    assert out["by_drafter"]["ngram"][1]["drafted"] > 0 and out["plain_tokens_per_second"] > 0


def test_copy_prompt_holds_the_passage(tmp_path):
    tok = make_tokenizer()
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(SENTENCES))
    prompt, rest = copy_prompt(tok, str(corpus), 400, "cpu")
    ids = prompt[0].tolist()
    assert len(ids) == 400
    passage = ids[-COPY_PRIMER:] + rest  # the prompt ends with the passage's first tokens
    n = len(passage)
    assert any(ids[i : i + n] == passage for i in range(len(ids) - n))  # and holds all of it before
    with pytest.raises(ValueError, match="copy prompt"):
        copy_prompt(tok, str(corpus), 100, "cpu")


def test_cli_bench_spec_writes_json_and_png(tmp_path):
    from attn2ssm.cli import main

    teacher, corpus = save_tiny_teacher_and_corpus(tmp_path)
    draft, trained = tmp_path / "draft", tmp_path / "trained"
    assert main(["convert", "--teacher", str(teacher), "--mixer", "mamba2", "--out", str(draft)]) == 0
    assert main(["convert", "--teacher", str(teacher), "--mixer", "mamba2", "--out", str(trained)]) == 0
    out = tmp_path / "res" / "spec.json"
    argv = [
        "bench",
        "generate",
        "--spec",
        "--teacher",
        str(teacher),
        "--spec-targets",
        f"mamba2,pure={trained}",
        "--draft",
        str(draft),
        "--spec-contexts",
        "300",
        "--spec-k",
        "2",
        "--spec-new-tokens",
        "5",
        "--rounds",
        "1",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    rows = result["speculative"]
    assert {(r["target"], r["task"]) for r in rows} == {
        (t, task) for t in ("mamba2", "pure") for task in ("continue", "copy")
    }
    assert all(set(r["by_drafter"]) == {"ngram", "model:draft"} for r in rows)
    assert all(x["identical_to_plain_greedy"] for r in rows for xs in r["by_drafter"].values() for x in xs)
    assert "plain_copies_passage" in rows[1] and result["targets"]["pure"] == str(trained)
    assert result["environment"]["torch"] == torch.__version__ and "command" in result


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--draft", "/nope"], "add --spec"),
        (["--spec-targets", "mamba2"], "add --spec"),
        (["--spec", "--spec-targets", "gpt5"], "unknown student 'gpt5'"),
        (["--spec", "--spec-targets", "m=/nope"], "/nope has no config.json"),
        (["--spec", "--spec-drafters", "lookup"], "--spec-drafters"),
        (["--spec", "--spec-drafters", ""], "no drafter"),
        (["--spec", "--draft", "/nope"], "--draft /nope"),
    ],
)
def test_spec_bad_flags_are_one_line(flags, needle, capsys):
    from attn2ssm.cli import main

    assert main(["bench", "generate", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
