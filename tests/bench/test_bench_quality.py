"""``attn2ssm bench quality`` on a tiny teacher: budgets split over stages, a cell distilled in its
own process then scored and cached, a half-run cell resumed, ``--only``, the outputs, errors.

The grid fixture runs one real cell (a tiny two-stage recipe, 384 tokens) through the CLI; tests
that change a grid work on a copy of it, so they do not depend on each other's order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.bench.quality import (
    FAMILIES,
    EvalSettings,
    GridSettings,
    budget_overrides,
    earlier_cells,
    load_family,
    parse_budgets,
    parse_family_table,
    plan_cells,
    run_grid,
    select_cells,
)
from attn2ssm.cli import main
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.errors import ConfigError
from attn2ssm.eval.perplexity import perplexity
from tiny_models import BASE_RECIPE, make_tokenizer, tiny_config, tiny_model

WORDS = "the union state people congress nation law work peace war year future hope country".split()
TINY_RECIPE = """\
name: tiny
description: two stages, weights 2 to 1, 64 tokens a step
data: {{corpus: {corpus}, block_len: 32, max_heldout_tokens: 2000}}
student: {{mixer: linear_attention}}
stages:
  - {{name: kd, kind: kd, tokens: 2000, batch_size: 2, save_every: 1, optim: {{lr: 0.01}}}}
  - {{name: ce, kind: ce, tokens: 1000, batch_size: 2, trainable: [all], save_every: 2, optim: {{lr: 0.001}}}}
eval: {{max_tokens: 256}}
"""


# ------------------------------------------------------------------------------------- pure parts
def test_budget_is_split_over_stages_by_their_tokens_in_whole_steps():
    # stages 16384 : 8192, 4 × 256 tokens a step
    recipe, raw = load_family("q", BASE_RECIPE, [], "smollm2-135m")
    sets, shares = budget_overrides(recipe, raw, 65536)
    assert shares == [44032, 21504] and sum(shares) == 65536  # 43 and 21 steps of 1024
    assert sets == ["stages.0.tokens=44032", "stages.1.tokens=21504"]
    _, shares = budget_overrides(recipe, raw, 2**20)
    assert shares == [699392, 349184]  # 2 : 1 to within a step
    with pytest.raises(ConfigError, match="less than one optimizer step per stage"):
        budget_overrides(recipe, raw, 1000)
    _, shares = budget_overrides(recipe, raw, 2048)
    assert shares == [1024, 1024]  # every stage runs at least one step


def test_a_stage_switched_off_stays_off_in_every_budget():
    """linear_hybrid25's optional long_kd (tokens 0, block_len 4096) gets no share; the other two
    split the budget 3 : 1 in steps of 2 × 1024 tokens as before."""
    recipe, raw = load_family("l", "linear_hybrid25", [], "smollm2-135m")
    sets, shares = budget_overrides(recipe, raw, 65536)
    assert shares == [49152, 16384, 0] and sets[-1] == "stages.2.tokens=0"
    # on: its steps are 1 × 4096 tokens
    recipe, raw = load_family("l", "linear_hybrid25", ["stages.2.tokens=16384"], "smollm2-135m")
    _, shares = budget_overrides(recipe, raw, 81920)
    assert shares == [49152, 16384, 16384]


def test_epochs_stage_needs_a_tokens_weight_and_then_runs_by_tokens():
    recipe, raw = load_family("m", "mamba_in_llama", [], "smollm2-135m")  # its sft stage runs for epochs: 1
    with pytest.raises(ConfigError, match=r"stage 3 \(sft\) runs for epochs=1.0 and has no tokens field"):
        budget_overrides(recipe, raw, 65536, "m")
    recipe, raw = load_family("m", "mamba_in_llama", ["stages.3.tokens=16384"], "smollm2-135m")
    sets, shares = budget_overrides(recipe, raw, 65536, "m")
    # its step counts padded positions: 4 × data.max_len
    assert shares[:3] == [16384] * 3 and shares[3] == 11 * 4 * 384
    assert "stages.3.epochs=null" in sets and "stages.3.tokens=16896" in sets
    scaled = load_recipe("mamba_in_llama", ["stages.3.tokens=16384", *sets])
    assert scaled.stages[3].epochs is None and [s.tokens for s in scaled.stages] == shares


def test_cell_selection_budgets_and_only():
    table = parse_family_table(["qs=quickstart"])
    assert list(table)[: len(FAMILIES)] == list(FAMILIES) and table["qs"] == "quickstart"
    assert select_cells(table, "qs", "65536,2^18", None) == [("qs", 65536), ("qs", 262144)]
    assert len(select_cells(table, None, None, None)) == 3 * len(table)  # every family × 2^16, 2^18, 2^20
    assert select_cells(table, None, None, "qs@4096, mamba2@2**16,qs@4096") == [
        ("qs", 4096),
        ("mamba2", 65536),
    ]
    assert parse_budgets("262144,65536,65536") == (65536, 262144)
    for bad in ("0", "x", "", "-5", "2^"):
        with pytest.raises(ConfigError, match="--budgets"):
            parse_budgets(bad)
    with pytest.raises(ConfigError, match="unknown family 'nope'"):
        select_cells(table, "qs,nope", None, None)
    with pytest.raises(ConfigError, match="FAMILY@TOKENS"):
        select_cells(table, None, None, "qs")
    with pytest.raises(ConfigError, match="--only names its cells itself"):
        select_cells(table, "qs", None, "qs@4096")


def test_perplexity_predictions_are_each_windows_argmax():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    full = perplexity(model, ids, window=70, predictions=True)
    with torch.no_grad():
        assert torch.equal(full["argmax"], model(input_ids=ids[None]).logits[0, :-1].argmax(-1))
    strided = perplexity(model, ids, window=16, stride=8, predictions=True)
    assert strided["argmax"].shape == (69,) and strided["ppl"] == pytest.approx(
        perplexity(model, ids, window=16, stride=8)["ppl"]
    )
    with torch.no_grad():  # token 40 is scored in the window [32, 48): predicted from tokens 32..39
        assert strided["argmax"][39] == model(input_ids=ids[None, 32:48]).logits[0, 7].argmax()


# ------------------------------------------------------------------------------------- one-line CLI errors
def _cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "attn2ssm", "bench", "quality", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--families", "mamba2,nope"], "unknown family 'nope'"),
        (
            ["--family", "ghost=no_such_recipe", "--families", "ghost"],
            "family 'ghost' needs recipe 'no_such_recipe', which does not exist",
        ),
        (
            ["--families", "qs", "--family", "qs=quickstart", "--budgets", "65536,lots"],
            "--budgets 'lots' is not a positive token count",
        ),
        (
            ["--family", "qs=quickstart", "--families", "qs", "--budgets", "512"],
            "a budget of 512 tokens is less than one optimizer step per stage",
        ),
        (["--family", "qs=quickstart", "--only", "qs-4096"], "is not FAMILY@TOKENS"),
        (["--family", "a/b=quickstart"], "is not NAME=RECIPE with a plain name"),
        (
            ["--family", "qs=quickstart", "--families", "qs", "--suite", "huge"],
            "--suite 'huge' is not a suite",
        ),
    ],
)
def test_bad_input_is_one_line(args, needle, tmp_path):
    r = _cli(*args, "--out-dir", tmp_path / "grid", "--json", tmp_path / "q.json")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        r.stderr.count("\n") == 1
        and r.stderr.startswith("error: ")
        and " — " in r.stderr
        and needle in r.stderr
    ), r.stderr
    assert not (tmp_path / "grid").exists() and not (tmp_path / "q.json").exists()


# ------------------------------------------------------------------------------------- the grid end to end
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scoreboard")
    tok = make_tokenizer(300)
    cfg = tiny_config("llama")
    cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_id = len(tok), 512, tok.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    rng = random.Random(0)
    (root / "corpus").mkdir()
    for i in range(16):
        (root / "corpus" / f"doc{i:02d}.txt").write_text(
            " ".join(rng.choice(WORDS) for _ in range(400)).capitalize() + ".\n"
        )
    book = root / "book.txt"  # one document: its last ~5 % is held out
    book.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(60)) + "\n")
    (root / "tiny.yaml").write_text(TINY_RECIPE.format(corpus=root / "corpus"))
    return SimpleNamespace(
        root=root, teacher=root / "teacher", corpora=f"{root / 'corpus'},{book}", recipe=root / "tiny.yaml"
    )


def _args(setup, grid: Path, *extra) -> list[str]:
    return [
        "bench",
        "quality",
        "--no-progress",
        "--teacher",
        str(setup.teacher),
        "--family",
        f"tiny={setup.recipe}",
        "--out-dir",
        str(grid),
        "--json",
        str(grid.parent / "results" / "quality.json"),
        "--corpora",
        setup.corpora,
        "--windows",
        "32,64",
        "--eval-tokens",
        "256",
        "--agreement-prompts",
        "2",
        "--passkey-lengths",
        "200,300",
        "--passkey-depths",
        "0,1",
        "--passkey-trials",
        "1",
        "--suite",
        "none",
        *extra,
    ]


def _settings(setup, grid: Path, cells) -> GridSettings:
    return GridSettings(
        teacher=str(setup.teacher),
        families=parse_family_table([f"tiny={setup.recipe}"]),
        cells=cells,
        grid_dir=grid,
        json_path=grid.parent / "results" / "quality.json",
        eval=EvalSettings(
            corpora=tuple(setup.corpora.split(",")),
            windows=(32, 64),
            eval_tokens=256,
            agreement_prompts=2,
            passkey_lengths=(200, 300),
            passkey_depths=(0.0, 1.0),
            passkey_trials=1,
        ),
    )


def _runs(cell_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (cell_dir / "cell_runs.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def grid(setup, tmp_path_factory):
    """A grid with one finished cell, tiny@384, filled by the CLI."""
    grid = tmp_path_factory.mktemp("grid") / "quality"
    assert main(_args(setup, grid, "--families", "tiny", "--budgets", "384")) == 0
    return grid


def _copy(grid: Path, tmp_path: Path) -> Path:
    shutil.copytree(grid, tmp_path / "quality")
    return tmp_path / "quality"


def test_cell_is_distilled_scored_and_written(setup, grid):
    cell = json.loads((grid / "tiny-384" / "cell.json").read_text())
    assert cell["command"] == (
        f"attn2ssm distill {setup.recipe} --out {grid / 'tiny-384'} --resume --set stages.0.tokens=256 "
        f"--set stages.1.tokens=128 --teacher {setup.teacher}"
    )
    assert cell["stage_tokens"] == [256, 128] and cell["train_tokens"] == 384 and cell["steps"] == 6
    assert cell["data"] == {"corpus": str(setup.root / "corpus"), "block_len": 32}  # the recipe's, resolved
    assert len(_runs(grid / "tiny-384")) == 1 and _runs(grid / "tiny-384")[0]["returncode"] == 0
    assert cell["wall_seconds"] > cell["train_seconds"] > 0 and cell["train_tokens_per_s"] == pytest.approx(
        384 / cell["train_seconds"]
    )

    result = json.loads((grid.parent / "results" / "quality.json").read_text())
    assert result["teacher"] == str(setup.teacher) and result["families"] == {"tiny": str(setup.recipe)}
    assert {"machine", "torch", "transformers", "python"} <= set(result["environment"]) and result[
        "command"
    ].startswith("attn2ssm bench quality")
    assert result["settings"]["windows"] == [32, 64] and result["stale_cells"] == []
    (rec,) = result["cells"]
    assert {
        "family",
        "recipe",
        "tokens",
        "command",
        "perplexity",
        "generation_agreement",
        "passkey",
        "wall_seconds",
        "train_tokens_per_s",
    } <= set(rec)
    assert (rec["family"], rec["recipe"], rec["tokens"], rec["command"]) == (
        "tiny",
        str(setup.recipe),
        384,
        cell["command"],
    )
    corpora = setup.corpora.split(",")
    assert set(rec["perplexity"]) == set(corpora)
    teacher_ref = result["teacher_reference"]["perplexity"]
    for corpus in corpora:
        for window in ("32", "64"):
            p = rec["perplexity"][corpus][window]
            assert (
                p["ppl"] > 1
                and p["ppl_ratio"] == pytest.approx(p["ppl"] / p["teacher_ppl"])
                and 0 <= p["top1_agreement"] <= 1
            )
            assert p["tokens"] == 255 and teacher_ref[corpus][window]["ppl"] == p["teacher_ppl"]
    # really two windows
    assert rec["perplexity"][corpora[0]]["32"]["ppl"] != rec["perplexity"][corpora[0]]["64"]["ppl"]
    agree = rec["generation_agreement"]
    assert agree["prompts"] == 2 and agree["new_tokens"] == 32 and 0 <= agree["token_agreement"] <= 1
    assert set(rec["passkey"]["accuracy"]) == {"200", "300"} == set(rec["passkey"]["teacher_accuracy"])
    assert set(rec["passkey"]["recall"]) == {"200", "300"} == set(rec["passkey"]["teacher_recall"])
    assert all(0 <= v <= 1 for v in rec["passkey"]["recall"].values())
    # the teacher's references are cached once for the grid: ppl + argmax per corpus × window, continuations, passkey
    names = sorted(p.name.split("-")[0] for p in (grid / "teacher").iterdir())
    assert names == ["continuations", "passkey", "ppl", "ppl", "ppl", "ppl"]

    assert (grid.parent / "results" / "quality.png").read_bytes()[:4] == b"\x89PNG"
    md = (grid.parent / "results" / "quality.md").read_text()
    assert "| teacher |" in md and f"`{cell['command']}`" in md and "| tiny | 384 | corpus · 32 |" in md


def test_second_invocation_reuses_the_cell_and_only_adds_cells(setup, grid, tmp_path, capsys):
    grid = _copy(grid, tmp_path)
    before = (grid / "tiny-384" / "cell.json").read_bytes()
    assert main(_args(setup, grid, "--only", "tiny@192")) == 0  # a new cell; tiny@384 is not selected
    assert (grid / "tiny-384" / "cell.json").read_bytes() == before and len(_runs(grid / "tiny-384")) == 1
    assert json.loads((grid / "tiny-192" / "cell.json").read_text())["train_tokens"] == 192
    assert not (grid / "tiny-65536").exists()
    result = json.loads((grid.parent / "results" / "quality.json").read_text())
    assert [c["tokens"] for c in result["cells"]] == [192, 384]  # rebuilt from every cached cell
    assert result["selected"] == ["tiny@192"]

    capsys.readouterr()
    assert main(_args(setup, grid, "--families", "tiny", "--budgets", "192,384")) == 0
    assert "[1/2] tiny@192: cached" in capsys.readouterr().out
    assert (grid / "tiny-384" / "cell.json").read_bytes() == before and len(_runs(grid / "tiny-192")) == 1


def test_plan_lists_each_cell_with_its_status_data_and_command_and_runs_nothing(
    setup, grid, tmp_path, capsys
):
    grid = _copy(grid, tmp_path)
    capsys.readouterr()
    assert main(_args(setup, grid, "--families", "tiny", "--budgets", "192,384", "--plan")) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and not (grid / "tiny-192").exists()
    todo, done = (line.split() for line in lines)
    assert todo[:5] == ["tiny@192", "todo", "corpus", "·", "32"] and done[:5] == [
        "tiny@384",
        "done",
        "corpus",
        "·",
        "32",
    ]
    assert lines[1].endswith(
        f"attn2ssm distill {setup.recipe} --out {grid / 'tiny-384'} --resume --set stages.0.tokens=256 "
        f"--set stages.1.tokens=128 --teacher {setup.teacher}"
    )


def test_cells_of_an_earlier_grid_json_survive_a_session_without_their_run_dirs(setup, grid, tmp_path):
    """A new machine's grid directory lacks the cells an earlier session committed in the grid
    JSON: a new cell adds to the JSON, it does not replace it (the cells keep their results and
    say where they came from); cells scored with other settings or for another teacher are not taken."""
    old_json = grid.parent / "results" / "quality.json"
    (tmp_path / "results").mkdir()
    shutil.copy(old_json, tmp_path / "results" / "quality.json")
    fresh = tmp_path / "quality"
    assert main(_args(setup, fresh, "--only", "tiny@192")) == 0
    assert not (fresh / "tiny-384").exists()
    result = json.loads((tmp_path / "results" / "quality.json").read_text())
    assert [c["tokens"] for c in result["cells"]] == [192, 384]
    (old,) = json.loads(old_json.read_text())["cells"]
    kept = result["cells"][1]
    assert (
        kept["perplexity"] == old["perplexity"]
        and kept["command"] == old["command"]
        and "not in this grid directory" in kept["from"]
    )
    assert "from" not in result["cells"][0]
    md = (tmp_path / "results" / "quality.md").read_text()
    assert "| tiny | 384 |" in md and "| tiny | 192 |" in md

    settings = _settings(setup, fresh, [])
    (again,) = earlier_cells(old_json, str(setup.teacher), settings.eval, set())
    assert {k: v for k, v in again.items() if k != "from"} == old
    assert earlier_cells(old_json, str(setup.teacher), settings.eval, {("tiny", 384)}) == []
    assert earlier_cells(old_json, "another-teacher", settings.eval, set()) == []
    other = dataclasses.replace(settings.eval, eval_tokens=128)
    assert earlier_cells(old_json, str(setup.teacher), other, set()) == []
    assert earlier_cells(tmp_path / "missing.json", str(setup.teacher), settings.eval, set()) == []


KILLER = r"""
import os, signal, sys
import attn2ssm.distill.trainer as T
original = T.Distiller._save_checkpoint

def save_then_die(self, *args, **kwargs):
    original(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # after the first complete checkpoint (stage 0, step 1)

T.Distiller._save_checkpoint = save_then_die
from attn2ssm.cli import main
main(sys.argv[1:])
"""


def test_half_run_cell_resumes_from_its_checkpoint(setup, grid, tmp_path, capfd):
    grid = _copy(grid, tmp_path)
    (cell,) = plan_cells(_settings(setup, grid, [("tiny", 256)]))
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, *cell.argv(), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (cell.run_dir / "checkpoints" / "latest").read_text() == "stage0-step000001" and not (
        cell.run_dir / "student"
    ).exists()
    assert cell.status(_settings(setup, grid, []).eval) == "partial"

    capfd.readouterr()
    assert main(_args(setup, grid, "--only", "tiny@256")) == 0
    out = capfd.readouterr().out
    # the second line is the trainer's
    assert "tiny@256: resuming" in out and "resuming from stage0-step000001" in out
    steps = [
        (r["stage_index"], r["step"])
        for r in map(json.loads, (cell.run_dir / "metrics.jsonl").read_text().splitlines())
    ]
    assert steps == [(0, 1), (0, 2), (0, 3), (1, 1)]  # 192 + 64 tokens, step 1 not run twice
    record = json.loads((cell.run_dir / "cell.json").read_text())
    assert (
        record["train_tokens"] == 256 and record["command"] == cell.command and len(_runs(cell.run_dir)) == 1
    )


def test_changed_eval_settings_rescore_without_retraining(setup, grid, tmp_path):
    grid = _copy(grid, tmp_path)
    before = json.loads((grid / "tiny-384" / "cell.json").read_text())
    assert main(_args(setup, grid, "--only", "tiny@384", "--windows", "48")) == 0
    after = json.loads((grid / "tiny-384" / "cell.json").read_text())
    assert len(_runs(grid / "tiny-384")) == 1  # no distill run
    assert set(after["perplexity"][setup.corpora.split(",")[0]]) == {"48"} and after["eval_settings"][
        "windows"
    ] == [48]
    assert after["train_tokens"] == before["train_tokens"]


def test_a_cell_scored_before_passkey_recall_is_rescored_without_retraining(setup, grid, tmp_path):
    grid = _copy(grid, tmp_path)
    path = grid / "tiny-384" / "cell.json"
    old = json.loads(path.read_text())
    for key in ("recall", "teacher_recall"):
        del old["passkey"][key]
    path.write_text(json.dumps(old))
    assert main(_args(setup, grid, "--only", "tiny@384")) == 0
    after = json.loads(path.read_text())
    # no distill run
    assert len(_runs(grid / "tiny-384")) == 1 and after["train_tokens"] == old["train_tokens"]
    assert set(after["passkey"]["recall"]) == {"200", "300"}


def test_a_run_dir_of_another_recipe_or_teacher_is_refused(setup, grid, tmp_path, capsys):
    grid = _copy(grid, tmp_path)
    capsys.readouterr()
    assert main(_args(setup, grid, "--only", "tiny@384", "--set", "stages.0.optim.lr=0.5")) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "holds a run of another recipe, budget or teacher than cell tiny@384" in err
    )
    other = _settings(setup, grid, [("tiny", 384)])
    other.teacher = str(setup.root / "another-teacher")
    with pytest.raises(ConfigError, match="holds cells distilled from teacher"):
        run_grid(other, progress=False)


def test_a_recipe_whose_description_changed_still_names_its_cached_run(setup, grid, tmp_path):
    """A recipe's description updated with its measured figures is prose, not a setting."""
    grid = _copy(grid, tmp_path)
    before = json.loads((grid / "tiny-384" / "cell.json").read_text())
    assert main(_args(setup, grid, "--only", "tiny@384", "--set", "description=measured since")) == 0
    after = json.loads((grid / "tiny-384" / "cell.json").read_text())
    assert len(_runs(grid / "tiny-384")) == 1 and after["train_tokens"] == before["train_tokens"]


def test_family_scoped_overrides_apply_to_that_family_only():
    from attn2ssm.bench.quality import family_sets

    table = {"a": "lolcats", "b": "lolcats"}
    sets = ["seed=1", "a:student.mixer_options.window=32", "b:data.corpus=hf:x:y"]
    assert family_sets(sets, "a", table) == ["seed=1", "student.mixer_options.window=32"]
    assert family_sets(sets, "b", table) == ["seed=1", "data.corpus=hf:x:y"]
    # a colon in the value is not a family
    assert family_sets(["data.corpus=hf:x"], "a", table) == ["data.corpus=hf:x"]
    with pytest.raises(ConfigError, match="unknown family 'c'"):
        family_sets(["c:seed=2"], "a", table)


def _synthetic_result(budgets: list[int]) -> dict:
    cells = [
        {"family": f, "tokens": t, "perplexity": {"sotu": {"1024": {"ppl_ratio": r}}}}
        for f, r in (("a", 1.5), ("b", 2.0))
        for t in budgets
    ]
    return {"teacher": "t", "settings": {"windows": [1024], "corpora": ["sotu"]}, "cells": cells}


@pytest.mark.parametrize("budgets, bars", [([65536], True), ([65536, 262144], False)])
def test_plot_is_bars_for_a_one_budget_sweep_and_curves_for_a_grid(budgets, bars, tmp_path, monkeypatch):
    import attn2ssm.bench.quality.report as sb  # plot_quality reads _plot_sweep there

    called = []
    real = sb._plot_sweep
    monkeypatch.setattr(sb, "_plot_sweep", lambda *a: called.append(a) or real(*a))
    path = sb.plot_quality(_synthetic_result(budgets), tmp_path / "q.png")
    assert path.read_bytes()[:4] == b"\x89PNG" and bool(called) == bars


def test_a_family_whose_cells_trained_on_other_data_plots_a_curve_for_each():
    """A recipe whose data changed between budgets (sotu · 1024, then a mixture · 2048) is two curves,
    each labelled with its data; a family with one kind of data keeps its name."""
    from attn2ssm.bench.quality.report import _lines

    cell = lambda f, t, corpus, block: {
        "family": f,
        "tokens": t,
        "data": {"corpus": corpus, "block_len": block},
    }  # noqa: E731
    cells = [
        cell("a", 65536, "sotu", 1024),
        cell("a", 1048576, "sotu", 1024),
        cell("a", 524288, "mix:general", 2048),
    ]
    cells.append(cell("b", 65536, "sotu", 1024))
    lines = _lines(cells)
    assert {k: [c["tokens"] for c in v] for k, v in lines.items()} == {
        "a (sotu · 1024)": [65536, 1048576],
        "a (mix:general · 2048)": [524288],
        "b": [65536],
    }


def test_a_key_added_to_recipes_since_does_not_orphan_a_cached_cell(setup, grid, tmp_path):
    """A run saved before the toolkit grew a recipe key (here: drop a defaulted stage key from its
    recipe.yaml) is still the same cell: reused, not refused or retrained."""
    import yaml

    grid = _copy(grid, tmp_path)
    saved = grid / "tiny-384" / "recipe.yaml"
    raw = yaml.safe_load(saved.read_text())
    dropped = [s.pop("logit_cache") for s in raw["stages"] if "logit_cache" in s]
    assert dropped, "the saved recipe should hold the defaulted key"
    saved.write_text(yaml.safe_dump(raw))
    assert main(_args(setup, grid, "--families", "tiny", "--budgets", "384")) == 0
    assert len(_runs(grid / "tiny-384")) == 1


def test_passkey_table_cells_show_accuracy_and_recall():
    from attn2ssm.bench.quality.report import _passkey_cell

    scored = {"accuracy": {"1024": 0.0, "2048": 0.5}, "recall": {"1024": 1.0, "2048": 0.5}}
    assert _passkey_cell(scored, "1024") == "0% · 100%" and _passkey_cell(scored, "2048") == "50% · 50%"
    # a cell scored before recall existed
    assert _passkey_cell({"accuracy": {"1024": 1 / 3}}, "1024") == "33%"
    assert _passkey_cell({}, "1024") == "–"


# ------------------------------------------------------------------------------------- the evaluation suite
def _tiny_suite(setup):
    from attn2ssm.eval.suite_settings import SuiteSettings, TaskSpec

    return SuiteSettings(
        name="tiny",
        corpora=(str(setup.root / "corpus"),),
        windows=(32,),
        max_tokens=256,
        tasks=(TaskSpec("arc_easy", "acc", 0, 2, "ARC-e"),),
        generation=None,
        niah_forms=("niah_single_1",),
        niah_lengths=(400,),
        niah_trials=2,
        batch_size=2,
    )


def test_the_suite_is_added_to_a_cached_cell_without_retraining(setup, grid, tmp_path):
    pytest.importorskip("lm_eval", reason="needs lm_eval (pip install -e '.[eval]')")
    grid = _copy(grid, tmp_path)
    settings = _settings(setup, grid, [("tiny", 384)])
    settings.eval = dataclasses.replace(settings.eval, suite=_tiny_suite(setup))
    cell = plan_cells(settings)[0]
    assert cell.status(settings.eval) == "suite"  # scored on everything but the suite
    before = json.loads((grid / "tiny-384" / "cell.json").read_text())
    del before["data"]  # a cell recorded before cells said what they trained on: the rescoring adds it
    (grid / "tiny-384" / "cell.json").write_text(json.dumps(before))
    result = run_grid(settings, progress=False)
    after = json.loads((grid / "tiny-384" / "cell.json").read_text())
    assert len(_runs(grid / "tiny-384")) == 1  # no distill run
    assert after["data"] == cell.data == {"corpus": str(setup.root / "corpus"), "block_len": 32}
    # the cached numbers kept
    assert after["perplexity"] == before["perplexity"] and after["passkey"] == before["passkey"]
    assert after["suite"]["settings"] == settings.eval.suite.as_dict()
    ids = [r["id"] for r in after["suite"]["rows"]]
    assert ids == [
        f"ppl/{setup.root / 'corpus'}/32",
        "task/arc_easy/0",
        "niah/niah_single_1/400",
        "niah/niah_single_1/400/recall",
    ]
    assert all(r["teacher"] is not None and r["student"] is not None for r in after["suite"]["rows"])
    assert list((grid / "teacher").glob("suite-*.json"))  # the teacher's units, cached once per grid
    assert (
        result["suite"] == settings.eval.suite.as_dict()
        and result["cells"][0]["suite"]["rows"] == after["suite"]["rows"]
    )
    md = (grid.parent / "results" / "quality.md").read_text()
    assert (
        "Suite tiny" in md
        and "| family | tokens | data | core avg | NIAH @400 | ppl ratio, other domains @32 | suite CPU s |"
        in md
    )
    assert cell.status(settings.eval) == "done"
    # another student-side change only: the teacher's rows come from the cache, numbers unchanged
    (grid / "tiny-384" / "cell.json").write_text(json.dumps({**after, "suite": {"settings": "old"}}))
    run_grid(settings, progress=False)
    again = json.loads((grid / "tiny-384" / "cell.json").read_text())
    assert [r["teacher"] for r in again["suite"]["rows"]] == [r["teacher"] for r in after["suite"]["rows"]]
    assert all(r["cpu_seconds"]["teacher"] is None for r in again["suite"]["rows"])


def test_an_invocation_without_the_suite_keeps_the_cells_scored_on_it(setup, grid, tmp_path):
    """--suite none adds or rescores cells without the suite; the table of those scored on it stays."""
    pytest.importorskip("lm_eval", reason="needs lm_eval (pip install -e '.[eval]')")
    grid = _copy(grid, tmp_path)
    settings = _settings(setup, grid, [("tiny", 384)])
    settings.eval = dataclasses.replace(settings.eval, suite=_tiny_suite(setup))
    run_grid(settings, progress=False)
    assert main(_args(setup, grid, "--only", "tiny@192")) == 0  # _args: --suite none
    result = json.loads((grid.parent / "results" / "quality.json").read_text())
    assert result["suite"] == settings.eval.suite.as_dict()
    assert [c["tokens"] for c in result["cells"]] == [192, 384] and result["cells"][0].get("suite") is None
    md = (grid.parent / "results" / "quality.md").read_text()
    assert "Suite tiny" in md and "| tiny | 384 | corpus · 32 | " in md.split("Suite tiny")[1]
    assert md.rstrip().endswith("or retrain them with --only): tiny@192.")


def test_suite_columns_and_panels_of_a_grid():
    import attn2ssm.bench.quality as sb
    from attn2ssm.eval.suite import pair_rows
    from attn2ssm.eval.suite_settings import SuiteSettings, TaskSpec

    suite = SuiteSettings(
        name="s",
        corpora=("kjv",),
        windows=(64,),
        tasks=(TaskSpec("arc_easy", "acc", 0, 4, "ARC-e"), TaskSpec("mmlu", "acc", 5, 1, "MMLU 5-shot")),
        generation=TaskSpec("triviaqa", "exact_match", 0, 4, "TQA"),
        niah_forms=("niah_single_1",),
        niah_lengths=(100,),
        niah_trials=4,
    )
    teacher = {
        "ppl/kjv/64": {"value": 10.0, "n": 9},
        "task/arc_easy/0": {"value": 0.5, "n": 4},
        "task/mmlu/5": {"value": 0.25, "n": 57},
        "task/triviaqa/0": {"value": 0.5, "n": 4},
        "niah/niah_single_1/100": {"value": 1.0, "n": 4},
        "niah/niah_single_1/100/recall": {"value": 1.0, "n": 4},
    }
    result = _synthetic_result([65536, 262144])
    result["suite"] = suite.as_dict()
    for i, cell in enumerate(result["cells"]):
        student = {k: {**v, "value": v["value"] * (0.5 + 0.1 * i)} for k, v in teacher.items()}
        student["ppl/kjv/64"]["value"] = 20.0
        cell["suite"] = {
            "settings": suite.as_dict(),
            "rows": pair_rows(suite, teacher, student),
            "cpu_seconds": 90.0,
        }
    result["cells"][-1]["suite"] = None  # a cell scored before the suite: named below the table
    result["cells"][0]["data"] = {"corpus": "mix:general", "block_len": 2048}
    lines = sb.format_suite_columns(result)
    assert (
        lines[2]
        == "| family | tokens | data | core avg | MMLU 5-shot | TQA | NIAH @100 | ppl ratio, other domains @64 | suite CPU s |"
    )
    assert lines[4] == "| teacher | – | – | 50.0 | 25.0 | 50.0 | 100.0 | 1.00× | – |"
    assert (
        lines[5]
        == "| a | 65,536 | mix:general · 2048 | 25.0 · 50% | 12.5 · 50% | 25.0 · 50% | 50.0 · 50% | 2.00× | 1.5 min |"
    )
    assert lines[7].startswith("| b | 65,536 | – | ") and lines[8] == "" and len(lines) == 10
    assert lines[-1].startswith("Not scored on the suite (") and lines[-1].endswith("--only): b@262,144.")
    path = sb.plot_quality(result, Path(os.environ.get("TMPDIR", "/tmp")) / f"suite-panels-{os.getpid()}.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    path.unlink()
