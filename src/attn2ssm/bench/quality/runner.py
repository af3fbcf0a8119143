"""How ``bench quality`` fills a grid: each cell's ``attn2ssm distill … --resume`` in its own
process, then scored (scoring.py) and cached in its ``cell.json``; the outputs rebuilt at the end
(report.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from attn2ssm.bench.quality.grid import Cell, GridSettings, has_checkpoint, plan_cells, read_cell, same_recipe
from attn2ssm.bench.quality.report import write_outputs
from attn2ssm.bench.quality.scoring import TeacherReference, evaluate_student, rescore_suite
from attn2ssm.errors import ConfigError, TrainingError
from attn2ssm.paths import atomic_write_text


def _check_run_dir(cell: Cell) -> None:
    """A run directory that holds a run of another recipe, budget or teacher is never continued."""
    if not same_recipe(cell):
        raise ConfigError(
            f"{cell.run_dir} holds a run of another recipe, budget or teacher than cell {cell.name}",
            f"delete {cell.run_dir} to rerun the cell, or use another --out-dir",
        )


def run_cell(cell: Cell, progress: bool = True) -> None:
    """``attn2ssm distill … --resume`` in a subprocess; its stderr (progress bars) passes through.
    Each invocation's wall time is appended to ``cell_runs.jsonl`` in the run directory."""
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    if not has_checkpoint(cell.run_dir):
        # a killed attempt without a checkpoint restarts from step 0
        (cell.run_dir / "metrics.jsonl").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "attn2ssm", *cell.argv(), *([] if progress else ["--no-progress"])]
    start, code, tail = time.time(), None, b""
    try:
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE)
        out = getattr(sys.stderr, "buffer", None)
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            tail = (tail + chunk)[-8192:]
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode("utf-8", "replace"))
        code = proc.wait()
    finally:
        with open(cell.run_dir / "cell_runs.jsonl", "a") as fh:
            fh.write(
                json.dumps({"started": start, "seconds": time.time() - start, "returncode": code}) + "\n"
            )
    if code != 0:
        lines = [
            ln.strip()
            for ln in tail.decode("utf-8", "replace").replace("\r", "\n").splitlines()
            if ln.strip()
        ]
        reason = next(
            (ln for ln in reversed(lines) if ln.startswith("error: ")),
            lines[-1] if lines else f"exit code {code}",
        )
        raise TrainingError(
            f"cell {cell.name}: attn2ssm distill failed ({reason.removeprefix('error: ')})",
            f"fix that and rerun: the cell resumes from its last checkpoint ({cell.command})",
        )


def training_stats(run_dir: Path) -> dict:
    """Wall time of the distill invocations, and training time / tokens from metrics.jsonl (each
    step's tokens over its measured rate), which survives kills and resumes."""
    from attn2ssm.eval.report import read_metrics

    runs = []
    path = Path(run_dir) / "cell_runs.jsonl"
    if path.exists():
        runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    metrics = read_metrics(run_dir)
    seconds, previous = 0.0, 0
    for rec in metrics:
        step = rec["total_tokens"] - previous
        previous = rec["total_tokens"]
        if rec.get("tokens_per_s"):
            seconds += step / rec["tokens_per_s"]
    total = metrics[-1]["total_tokens"] if metrics else 0
    return {
        "wall_seconds": sum(r["seconds"] for r in runs) if runs else None,
        "sessions": len(runs),
        "train_tokens": total,
        "train_seconds": seconds,
        "train_tokens_per_s": total / seconds if seconds else None,
        "steps": len(metrics),
    }


def _manifest(settings: GridSettings) -> None:
    """A grid directory belongs to one teacher: its cells and references are compared with it."""
    path = Path(settings.grid_dir) / "grid.json"
    if path.exists():
        teacher = json.loads(path.read_text()).get("teacher")
        if teacher != settings.teacher:
            raise ConfigError(
                f"grid directory {settings.grid_dir} holds cells distilled from teacher {teacher!r}, not {settings.teacher!r}",
                "use another --out-dir for this teacher (or the same --teacher)",
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"teacher": settings.teacher}) + "\n")


def fill_cell(cell: Cell, reference: TeacherReference, progress: bool = True) -> dict:
    """Train (or resume) and evaluate one cell, unless cell.json already holds it; returns the record."""
    status = cell.status(reference.settings)
    if status == "done":
        return read_cell(cell.run_dir)
    if status == "suite":
        return rescore_suite(cell, reference, progress)
    _check_run_dir(cell)
    if status != "trained":
        run_cell(cell, progress)
        if not cell.finished():
            raise TrainingError(
                f"cell {cell.name}: attn2ssm distill ended without a student in {cell.run_dir / 'student'}",
                f"rerun: the cell resumes ({cell.command})",
            )
    try:
        scores = evaluate_student(cell.run_dir / "student", reference, progress)
    finally:
        reference.release()
    record = {
        "family": cell.family,
        "recipe": cell.recipe_name,
        "tokens": cell.tokens,
        "stage_tokens": cell.stage_tokens,
        "command": cell.command,
        "run_dir": str(cell.run_dir),
        "teacher": cell.teacher,
        "data": cell.data,
        **scores,
        **training_stats(cell.run_dir),
        "recipe_sha": cell.recipe_sha,
        "eval_settings": reference.settings.as_dict(),
    }
    atomic_write_text(cell.run_dir / "cell.json", json.dumps(record, indent=1) + "\n")
    return record


def run_grid(
    settings: GridSettings,
    command: str = "attn2ssm bench quality",
    progress: bool = True,
    out=print,
    cells: list[Cell] | None = None,
) -> dict:
    """Fill the selected cells in order (``cells``: already planned), then rebuild the grid's JSON, PNG and markdown."""
    cells = plan_cells(settings) if cells is None else cells
    _manifest(settings)
    reference = TeacherReference(settings.teacher, settings.grid_dir, settings.eval, progress)
    for i, cell in enumerate(cells, 1):
        status = cell.status(settings.eval)
        out(
            f"[{i}/{len(cells)}] {cell.name}: "
            + {
                "done": "cached",
                "suite": "cached, scoring the suite",
                "trained": "trained, evaluating",
                "partial": "resuming",
                "todo": "distilling",
            }[status]
            + ("" if status in ("done", "suite", "trained") else f" ({cell.command})")
        )
        fill_cell(cell, reference, progress)
    return write_outputs(settings, reference, command, selected=[c.name for c in cells])
