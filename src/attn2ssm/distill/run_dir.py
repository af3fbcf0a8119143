"""A run directory: claiming it (its lock) and what a resume reads back from it before any work.

The main process holds an exclusive lock on ``.lock`` (released by the OS when the process dies)
before anything is written, so a second run on the same ``--out`` stops with one line naming the
first's pid. A resume reads the recipe saved there, checks that it is the run the command names,
finds the newest intact checkpoint and checks the metrics log; each problem is one line, found
before a teacher or corpus loads, and nothing on disk changes until then.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from accelerate.utils import broadcast_object_list

from attn2ssm.distill.checkpoints import checkpoint_root, choose_checkpoint, read_metrics
from attn2ssm.distill.recipe import RECOMPUTING, Recipe, resume_recipe
from attn2ssm.errors import CheckpointError, ConfigError, OutputError
from attn2ssm.paths import LOCK, atomic_write_text, check_writable, lock_dir, remove_stale_staging, writing

RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"


def resume_command(out: Path) -> str:
    import shlex

    return f"attn2ssm distill --out {shlex.quote(str(out))} --resume"


def writing_to(out: Path, what: str, where: Path | None = None, note: str = ""):
    """A write into the run directory: space or permission failures become one line naming it and the resume command."""
    return writing(where or out, what, f"continue with: {resume_command(out)}", note)


def saved_recipe(out: Path) -> dict | None:
    """The recipe a run saved in ``out`` as a dict (None: there is none), or a one-line error when it
    cannot be read as one."""
    path = Path(out) / RECIPE
    if not path.is_file():
        return None
    fix = (
        f"restore {path} from a copy (its checkpoints are untouched), or start the run again in another --out"
    )
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not text (damaged)", fix) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML{where} (damaged)", fix) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds no recipe (a YAML {type(raw).__name__}, damaged)", fix)
    return raw


def resumed_recipe(out: Path, recipe: Recipe, overrides: list[str] | None) -> tuple[Recipe, list]:
    """``(recipe, changes)`` for ``--resume``: the recipe saved in ``out`` with the ``--set`` changes
    ``resume_recipe`` allows, refused when ``recipe`` names another recipe; without a saved recipe,
    ``recipe`` itself (a fresh start, said on stderr)."""
    saved = saved_recipe(out)
    if saved is None:
        print(
            f"--resume: {out} holds no run to resume (no {RECIPE}): starting '{recipe.name}' from scratch",
            file=sys.stderr,
        )
        return recipe, []
    name = saved.get("name")
    if name is not None and name != recipe.name:
        raise ConfigError(
            f"--resume: {out} holds a run of recipe '{name}', not '{recipe.name}'",
            f"resume it without naming a recipe ({resume_command(out)}), or run '{recipe.name}' in another --out",
        )
    return resume_recipe(saved, overrides)


def report_resume_changes(changes: list) -> None:
    """A resume's ``--set`` changes, on stderr (by the main process)."""
    print(
        "--resume with --set: "
        + ", ".join(f"{key} {old!r} → {new!r}" for key, old, new in changes)
        + (
            "; the remaining steps compute with it (no longer bitwise an uninterrupted run)"
            if any(k.split(".")[-1] in RECOMPUTING for k, _, _ in changes)
            else ""
        ),
        file=sys.stderr,
    )


def hold_run_dir(out: Path, acc) -> tuple[object | None, bool]:
    """``(lock, made)``: the run directory's lock (the main process takes it before anything is
    written) and whether this run created the folder; an OutputError when it is not writable or
    another run holds it. Every process raises alike."""
    failure, lock, made = None, None, False
    if acc.is_main_process:
        try:
            check_writable(out)
            made = not out.exists()
            lock = lock_dir(out)
        except OutputError as exc:
            failure = exc
    if acc.num_processes > 1:
        shared = broadcast_object_list([str(failure) if failure else None])
        failure = failure or (OutputError(shared[0]) if shared[0] else None)
    if failure is not None:
        raise failure
    return lock, made


def release_run_dir(out: Path, lock, made: bool) -> None:
    """Let the lock go; a folder the run created that holds nothing but its lock file (it failed
    before writing) is removed."""
    if lock is None:
        return
    lock.close()
    if made and [p.name for p in out.iterdir()] == [LOCK]:
        (out / LOCK).unlink()
        out.rmdir()


def check_new_run(out: Path) -> None:
    """A run without ``--resume`` needs a directory that holds no run."""
    if (out / "checkpoints").exists() or (out / "student").exists():
        raise ConfigError(
            f"run directory {out} already holds a run",
            "pass --resume to continue it, or choose another --out",
        )


def intact_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint whose files match their manifest, with a one-line notice for each
    damaged one skipped; an error when there are checkpoints but none is intact. Reads only."""
    chosen, skipped = choose_checkpoint(out)
    if chosen is None and skipped:
        (newest, reason), names = skipped[0], ", ".join(folder.name for folder, _ in skipped)
        raise CheckpointError(
            f"no intact checkpoint in {out / 'checkpoints'}: {names} damaged ({newest.name}: {reason})",
            "restart the run without --resume in a new --out",
        )
    for folder, reason in skipped:
        print(f"checkpoint {folder.name} is damaged ({reason}); resuming from {chosen.name}", file=sys.stderr)
    return chosen


def check_metrics(out: Path) -> None:
    """Before a resume: the metrics log must be readable (one line otherwise); a last line the kill
    cut is dropped when the resume truncates the log, which one warning says."""
    _, cut = read_metrics(out / METRICS)
    if cut is not None:
        print(
            f"warning: {out / METRICS} ends in a line cut by the kill ({len(cut)} bytes); the resume drops it",
            file=sys.stderr,
        )


def start_writing(out: Path, recipe: Recipe, resumed: bool) -> None:
    """The first writes of a run (main process): a killed run's half-written checkpoint or student
    removed (the lock is ours), the resolved recipe saved, and a run from scratch keeps no metric
    line of an earlier attempt."""
    for folder in (out, checkpoint_root(out)):
        remove_stale_staging(folder, locked=True)
    with writing_to(out, RECIPE):
        atomic_write_text(out / RECIPE, recipe.to_yaml())
        if not resumed:
            (out / METRICS).unlink(missing_ok=True)
