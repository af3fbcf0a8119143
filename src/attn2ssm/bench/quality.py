"""``attn2ssm bench quality``: a fixed grid of student families × token budgets on one teacher.

A *family* is a recipe (built-in name or YAML path) plus a rule for scaling it to a budget: the
cell's training tokens are split over the recipe's stages in proportion to their ``tokens``
fields, each share rounded to whole optimizer steps (``batch_size`` × ``data.block_len``, or
× ``data.max_len`` for stages with their own dataset), and passed as
``--set stages.<i>.tokens=<n>``. A stage that runs for ``epochs`` is turned into a token stage
of its share (``--set stages.<i>.epochs=null``) when the recipe gives it a ``tokens`` field to
weigh it by; without one its share is unknown and the family is refused.

Each cell is a real ``attn2ssm distill RECIPE --out GRID/<family>-<tokens> --resume --set …
--teacher T`` in its own process, so a killed grid resumes: a cell whose ``cell.json`` holds
results for the current evaluation settings is not touched, a finished run is only evaluated,
a half-run continues from its checkpoint. After the run the student is evaluated here, one
student in memory at a time, against references the teacher computes once per grid
(``GRID/teacher/``): held-out perplexity at every window (stride = window / 2) on each corpus,
the teacher's, their ratio and teacher-forced top-1 agreement on the same windows; greedy
continuation agreement on held-out prompts of the first corpus; passkey accuracy per length; and,
with ``--suite`` (default ``quick``), every row of the evaluation suite (:mod:`attn2ssm.eval.suite`:
perplexity on five corpora, core tasks, MMLU 0/5-shot, RULER-form needles, TriviaQA), the teacher's
units cached once per grid in ``GRID/teacher/suite-*.json``. A cell scored before the suite existed
(or with another suite) keeps its numbers and is rescored for the suite alone, without retraining.
``cell.json`` (atomic) keeps the cell's command and results; the grid JSON, the plot and the
markdown table are rebuilt from every cached cell of the grid on each invocation, plus the cells
of the grid JSON already there that this grid directory lacks (same teacher and evaluation
settings): a grid is filled over several sessions on machines that do not share their ``runs/``,
and a session's new cells must not erase the cells an earlier one committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from attn2ssm.errors import ConfigError, TrainingError
from attn2ssm.paths import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from attn2ssm.eval.suite import SuiteSettings

# family name → recipe (built-in name or YAML path)
FAMILIES = {
    "lolcats": "lolcats",
    "mamba2": "mamba2_pure",
    "hybrid50": "hybrid50",
    "hybrid25": "hybrid25",
    "hybrid12": "hybrid12",
    "linear_hybrid25": "linear_hybrid25",
    "gdn": "gdn_pure",
    "gdn_hybrid25": "gdn_hybrid25",
}
DEFAULT_BUDGETS = (2**16, 2**18, 2**20)
DEFAULT_TEACHER = "smollm2-135m"


@dataclass
class EvalSettings:
    """What a cell is scored on; a cached cell scored with other settings is scored again."""

    corpora: tuple[str, ...] = ("sotu", "moby-dick")
    windows: tuple[int, ...] = (1024, 2048)
    eval_tokens: int = 16384  # held-out tokens per corpus
    agreement_prompts: int = 16
    agreement_prompt_len: int = 64
    agreement_new_tokens: int = 32
    passkey_lengths: tuple[int, ...] = (1024, 2048)
    passkey_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    passkey_trials: int = 2
    passkey_seed: int = 0
    suite: SuiteSettings | None = None  # the evaluation suite every cell is also scored on (None: not scored)

    def as_dict(self) -> dict:
        """The settings of the perplexity / agreement / passkey metrics (the suite's are kept apart,
        so the cells scored before the suite existed stay current for these)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k != "suite"}

    def suite_dict(self) -> dict | None:
        return None if self.suite is None else self.suite.as_dict()


@dataclass
class GridSettings:
    teacher: str = DEFAULT_TEACHER
    families: dict[str, str] = field(
        default_factory=lambda: dict(FAMILIES)
    )  # the table (built-in + --family)
    cells: list[tuple[str, int]] = field(default_factory=list)  # (family, tokens) to fill, in order
    sets: list[str] = field(
        default_factory=list
    )  # --set overrides: KEY=VALUE for every cell, FAMILY:KEY=VALUE for one family
    grid_dir: Path = Path("runs/quality")
    json_path: Path = Path("benchmarks/results/quality.json")
    eval: EvalSettings = field(default_factory=EvalSettings)


# ------------------------------------------------------------------------------------- parsing
def parse_tokens(flag: str, text: str) -> int:
    """A token count: ``65536`` or ``2^16`` (``2**16``)."""
    t = text.strip().replace("**", "^")
    try:
        value = int(t.split("^")[0]) ** int(t.split("^")[1]) if "^" in t else int(t)
    except (ValueError, IndexError):
        value = 0
    if value < 1:
        raise ConfigError(
            f"{flag} {text!r} is not a positive token count", f"write e.g. {flag} 65536,262144 (or 2^16,2^18)"
        )
    return value


def parse_budgets(text: str) -> tuple[int, ...]:
    items = [v for v in text.split(",") if v.strip()]
    if not items:
        raise ConfigError(f"--budgets {text!r} names no budget", "write e.g. --budgets 65536,262144")
    return tuple(sorted({parse_tokens("--budgets", v) for v in items}))


def parse_family_table(items: list[str] | None) -> dict[str, str]:
    """FAMILIES plus ``--family NAME=RECIPE`` entries (added, or replacing a built-in mapping)."""
    table = dict(FAMILIES)
    for item in items or []:
        name, sep, recipe = item.partition("=")
        name, recipe = name.strip(), recipe.strip()
        if (
            not sep or not recipe or not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*", name)
        ):  # names a run directory
            raise ConfigError(
                f"--family {item!r} is not NAME=RECIPE with a plain name (letters, digits, _ . -)",
                "write e.g. --family hedgehog=hedgehog or --family mine=my_recipe.yaml",
            )
        table[name] = recipe
    return table


def _known(name: str, table: dict[str, str], flag: str) -> str:
    if name not in table:
        raise ConfigError(
            f"{flag} names unknown family {name!r}",
            f"choose from {', '.join(table)}, or add one with --family {name}=RECIPE",
        )
    return name


def select_cells(
    table: dict[str, str], families: str | None, budgets: str | None, only: str | None
) -> list[tuple[str, int]]:
    """The cells to fill: ``--only fam@tokens,...`` alone, else every family × budget."""
    if only is not None:
        if families is not None or budgets is not None:
            raise ConfigError("--only names its cells itself", "drop --families / --budgets, or drop --only")
        cells = []
        for item in (v.strip() for v in only.split(",")):
            name, sep, tokens = item.partition("@")
            if not sep:
                raise ConfigError(
                    f"--only item {item!r} is not FAMILY@TOKENS",
                    "write e.g. --only hybrid25@65536,mamba2@262144",
                )
            cell = (_known(name.strip(), table, "--only"), parse_tokens("--only", tokens))
            if cell not in cells:
                cells.append(cell)
        return cells
    names = list(table) if families is None else [v.strip() for v in families.split(",") if v.strip()]
    if not names:
        raise ConfigError(f"--families {families!r} names no family", f"choose from {', '.join(table)}")
    names = list(dict.fromkeys(_known(n, table, "--families") for n in names))
    sizes = DEFAULT_BUDGETS if budgets is None else parse_budgets(budgets)
    return [(n, t) for n in names for t in sizes]


def family_sets(sets: list[str], family: str, table: dict[str, str]) -> list[str]:
    """The ``--set`` overrides that apply to ``family``: every ``KEY=VALUE``, and ``FAMILY:KEY=VALUE``
    for this family (so one grid can hold variants of one recipe, as a recipe sweep does)."""
    out = []
    for item in sets:
        key = item.partition("=")[0]
        if ":" not in key:
            out.append(item)
            continue
        name, _, rest = item.partition(":")
        if name not in table:
            raise ConfigError(
                f"--set {item!r} names unknown family {name!r}",
                f"write KEY=VALUE for every cell, or FAMILY:KEY=VALUE with one of {', '.join(table)}",
            )
        if name == family:
            out.append(rest)
    return out


# ------------------------------------------------------------------------------------- budgets
def _raw_recipe(name_or_path: str, sets: list[str]) -> dict:
    from attn2ssm.config import apply_overrides, load_yaml
    from attn2ssm.distill.recipe import builtin_recipes

    recipes = builtin_recipes()
    return apply_overrides(
        load_yaml(recipes[name_or_path] if name_or_path in recipes else name_or_path), list(sets)
    )


def load_family(family: str, recipe_name: str, sets: list[str], teacher: str):
    """(Recipe, raw stage dicts) of a family, with the grid's overrides and teacher applied."""
    from attn2ssm.distill.recipe import builtin_recipes, load_recipe

    try:
        recipe = load_recipe(recipe_name, list(sets))
    except ConfigError as exc:
        if recipe_name in builtin_recipes() or Path(recipe_name).exists():
            raise ConfigError(f"family {family!r} (recipe {recipe_name}): {exc.problem}", exc.fix) from exc
        raise ConfigError(
            f"family {family!r} needs recipe {recipe_name!r}, which does not exist",
            f"leave the family out (--families), or map it to a recipe with --family {family}=RECIPE (built-in: {', '.join(builtin_recipes())})",
        ) from exc
    recipe.teacher = teacher
    raw = _raw_recipe(recipe_name, sets).get("stages") or [{} for _ in recipe.stages]
    return recipe, raw


def stage_step_tokens(recipe, stage) -> int:
    """Tokens one optimizer step of ``stage`` counts (padded positions for stages with a dataset)."""
    return stage.batch_size * (
        stage.data.max_len if stage.data is not None else stage.block_len or recipe.data.block_len
    )


def budget_overrides(
    recipe, raw_stages: list[dict], tokens: int, family: str = ""
) -> tuple[list[str], list[int]]:
    """``--set`` strings giving every stage its share of ``tokens`` (proportional to the stages'
    ``tokens`` fields, rounded to whole optimizer steps, at least one), and the shares. A stage the
    recipe switches off (``tokens: 0``, no epochs) stays off: share 0."""
    where = f"family {family!r} (recipe {recipe.name})" if family else f"recipe {recipe.name}"
    sets, shares = [], []
    for i, stage in enumerate(recipe.stages):
        if stage.epochs is not None and "tokens" not in (raw_stages[i] if i < len(raw_stages) else {}):
            raise ConfigError(
                f"{where}: stage {i} ({stage.name}) runs for epochs={stage.epochs} and has no tokens field to weigh its share of a token budget",
                f"give the stage a tokens field in the recipe (its weight: it then runs for its share of the budget, not for epochs; "
                f"--set stages.{i}.tokens=N does it for a grid of this family alone), or leave the family out",
            )
    off = [s.tokens == 0 and s.epochs is None for s in recipe.stages]
    minimum = sum(stage_step_tokens(recipe, s) for s, o in zip(recipe.stages, off) if not o)
    if tokens < minimum:
        raise ConfigError(
            f"{where}: a budget of {tokens} tokens is less than one optimizer step per stage ({minimum} tokens)",
            f"use budgets of at least {minimum} tokens",
        )
    weight = sum(s.tokens for s in recipe.stages)
    for i, stage in enumerate(recipe.stages):
        step = stage_step_tokens(recipe, stage)
        share = 0 if off[i] else max(1, round(tokens * stage.tokens / weight / step)) * step
        shares.append(share)
        sets.append(f"stages.{i}.tokens={share}")
        if stage.epochs is not None:
            sets.append(f"stages.{i}.epochs=null")
    return sets, shares


# ------------------------------------------------------------------------------------- cells
@dataclass
class Cell:
    family: str
    recipe_name: str
    tokens: int
    run_dir: Path
    sets: list[str]  # the grid's overrides, then the budget's
    stage_tokens: list[int]
    teacher: str
    recipe_yaml: str  # the resolved recipe distill will save as recipe.yaml
    # what the student trains on, {"corpus": ..., "block_len": ...}: the scoreboard's "data" column
    data: dict

    @property
    def name(self) -> str:
        return f"{self.family}@{self.tokens}"

    def argv(self) -> list[str]:
        return [
            "distill",
            self.recipe_name,
            "--out",
            str(self.run_dir),
            "--resume",
            *[x for s in self.sets for x in ("--set", s)],
            "--teacher",
            self.teacher,
        ]

    @property
    def command(self) -> str:
        return shlex.join(["attn2ssm", *self.argv()])

    @property
    def recipe_sha(self) -> str:
        return hashlib.sha256(self.recipe_yaml.encode()).hexdigest()[:16]

    def finished(self) -> bool:
        return (self.run_dir / "student" / "config.json").exists() and (
            self.run_dir / "results.json"
        ).exists()

    def status(self, settings: EvalSettings) -> str:
        """done (cached for these settings) | suite (cached but for the suite: to score with it, not
        retrain) | trained (to evaluate) | partial (to resume) | todo."""
        cached = read_cell(self.run_dir)
        if (
            cached
            and cached.get("eval_settings") == settings.as_dict()
            and _same_recipe(self)
            and _has_every_metric(cached, settings)
        ):
            if (
                settings.suite is not None
                and (cached.get("suite") or {}).get("settings") != settings.suite_dict()
            ):
                return "suite" if self.finished() else "trained"
            return "done"
        if self.finished():
            return "trained"
        return "partial" if _has_checkpoint(self.run_dir) else "todo"


def _has_every_metric(record: dict, settings: EvalSettings) -> bool:
    """False for a cell scored before a metric was added (passkey recall): it is scored again."""
    return not settings.passkey_lengths or "recall" in record.get("passkey", {})


def _has_checkpoint(run_dir: Path) -> bool:
    root = Path(run_dir) / "checkpoints"
    return root.is_dir() and any(p.is_dir() and not p.name.startswith(".") for p in root.iterdir())


def plan_cells(settings: GridSettings) -> list[Cell]:
    """Every selected cell with its budget overrides; a missing recipe, an unscalable stage or a
    budget too small fails here, before anything runs."""
    import yaml

    from attn2ssm.distill.recipe import load_recipe

    families, cells = {}, []
    for family, tokens in settings.cells:
        sets = family_sets(settings.sets, family, settings.families)
        if family not in families:
            families[family] = load_family(family, settings.families[family], sets, settings.teacher)
        recipe, raw = families[family]
        budget_sets, shares = budget_overrides(recipe, raw, tokens, family)
        resolved = load_recipe(settings.families[family], [*sets, *budget_sets])
        resolved.teacher = settings.teacher
        cells.append(
            Cell(
                family,
                settings.families[family],
                tokens,
                Path(settings.grid_dir) / f"{family}-{tokens}",
                [*sets, *budget_sets],
                shares,
                settings.teacher,
                yaml.safe_dump(yaml.safe_load(resolved.to_yaml()), sort_keys=True),
                training_data(resolved),
            )
        )
    return cells


def training_data(recipe) -> dict:
    """The recipe's training text and block length, as a cell records them: a named corpus or
    built-in mixture by name, a listed mixture by its weights and sources."""
    data = recipe.data
    return {"corpus": data.corpus if data.corpus else data.describe(), "block_len": data.block_len}


def read_cell(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "cell.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _same_recipe(cell: Cell) -> bool:
    """Whether the run directory's saved recipe is the cell's. Both are compared as the current
    loader resolves them, so a key the toolkit added since (with its default) does not turn every
    cached cell of an earlier version into "another recipe"; without a saved recipe, cell.json's
    hash decides."""
    import yaml

    from attn2ssm.distill.recipe import load_recipe

    saved = cell.run_dir / "recipe.yaml"
    if saved.exists():
        return (
            yaml.safe_dump(yaml.safe_load(load_recipe(str(saved)).to_yaml()), sort_keys=True)
            == cell.recipe_yaml
        )
    cached = read_cell(cell.run_dir)
    return not cached or cached.get("recipe_sha") in (None, cell.recipe_sha)


def _check_run_dir(cell: Cell) -> None:
    """A run directory that holds a run of another recipe, budget or teacher is never continued."""
    if not _same_recipe(cell):
        raise ConfigError(
            f"{cell.run_dir} holds a run of another recipe, budget or teacher than cell {cell.name}",
            f"delete {cell.run_dir} to rerun the cell, or use another --out-dir",
        )


def run_cell(cell: Cell, progress: bool = True) -> None:
    """``attn2ssm distill … --resume`` in a subprocess; its stderr (progress bars) passes through.
    Each invocation's wall time is appended to ``cell_runs.jsonl`` in the run directory."""
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    if not _has_checkpoint(cell.run_dir):
        (cell.run_dir / "metrics.jsonl").unlink(
            missing_ok=True
        )  # a killed attempt without a checkpoint restarts from step 0
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


# ------------------------------------------------------------------------------------- teacher references
class TeacherReference:
    """The teacher's side of every comparison, computed once per grid and cached in ``GRID/teacher``
    (perplexity and top-1 predictions per corpus × window, greedy continuations, passkey accuracy).
    The teacher loads only when a reference is missing."""

    def __init__(self, spec: str, grid_dir: Path, settings: EvalSettings, progress: bool = True):
        self.spec, self.dir, self.settings, self.progress = (
            spec,
            Path(grid_dir) / "teacher",
            settings,
            progress,
        )
        self._model = None

    def release(self) -> None:
        """Drop the teacher (the next cell's distill process loads its own)."""
        self._model = None

    def model(self):
        if self._model is None:
            from attn2ssm.student.loading import load_model_and_tokenizer

            self._model, _ = load_model_and_tokenizer(self.spec)
        return self._model

    def _path(self, kind: str, key: dict, suffix: str) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        return self.dir / f"{kind}-{digest}{suffix}"

    def _ppl_path(self, corpus: str, window: int) -> Path:
        return self._path(
            "ppl",
            {
                "teacher": self.spec,
                "corpus": corpus,
                "window": window,
                "eval_tokens": self.settings.eval_tokens,
            },
            ".pt",
        )

    def _passkey_path(self) -> Path:
        s = self.settings
        key = {
            "teacher": self.spec,
            "lengths": list(s.passkey_lengths),
            "depths": list(s.passkey_depths),
            "trials": s.passkey_trials,
            "seed": s.passkey_seed,
        }
        return self._path("passkey", key, ".json")

    def perplexity(self, corpus: str, ids, window: int) -> dict:
        import io

        import torch

        from attn2ssm.eval.perplexity import perplexity

        ids_sha = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
        path = self._ppl_path(corpus, window)
        if path.exists():
            cached = torch.load(path, weights_only=True)
            if cached.get("ids_sha") == ids_sha:
                return cached
        r = perplexity(
            self.model(),
            ids,
            window=window,
            stride=window // 2,
            batch_size=_batch(window),
            progress=self.progress,
            desc=f"teacher {corpus} @{window}",
            predictions=True,
        )
        record = {
            "ppl": r["ppl"],
            "nll": r["nll"],
            "tokens": r["tokens"],
            "argmax": r["argmax"].to(torch.int32),
            "ids_sha": ids_sha,
        }
        buf = io.BytesIO()
        torch.save(record, buf)
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())
        return record

    def continuations(self, prompts, pad_id: int) -> list[list[int]]:
        from attn2ssm.eval.agreement import _greedy

        s = self.settings
        key = {
            "teacher": self.spec,
            "prompts": [p.tolist() for p in prompts],
            "new_tokens": s.agreement_new_tokens,
        }
        path = self._path("continuations", key, ".json")
        if path.exists():
            return json.loads(path.read_text())["continuations"]
        from tqdm.auto import tqdm

        refs = [
            _greedy(self.model(), p, s.agreement_new_tokens, pad_id)
            for p in tqdm(prompts, desc="teacher continuations", disable=not self.progress, leave=False)
        ]
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**key, "continuations": refs}))
        return refs

    def passkey(self, tokenizer) -> dict:
        s = self.settings
        path = self._passkey_path()
        if path.exists():
            cached = json.loads(path.read_text())
            if "recall" in cached:  # a grid cached before recall was scored is redone
                return cached
        from attn2ssm.eval.needle import passkey_grid

        grid = passkey_grid(
            self.model(),
            tokenizer,
            s.passkey_lengths,
            s.passkey_depths,
            s.passkey_trials,
            seed=s.passkey_seed,
            progress=self.progress,
            desc="teacher passkey",
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(grid))
        return grid

    def suite_cache(self):
        from attn2ssm.eval.suite import SideCache, model_identity

        return SideCache(self.dir, model_identity(self.spec))

    def suite_scores(self, tokenizer, inputs: dict) -> dict:
        """The teacher's rows of the suite: each unit from GRID/teacher/suite-*.json, or scored once
        (the teacher loads only then)."""
        from attn2ssm.eval.suite import score_side

        return score_side(
            None, tokenizer, self.settings.suite, inputs, self.suite_cache(), self.progress, loader=self.model
        )

    def cached_summary(self) -> dict:
        """The teacher's numbers for the current settings that are on disk (no model loads)."""
        import torch

        out: dict = {"perplexity": {}}
        for corpus in self.settings.corpora:
            for window in self.settings.windows:
                path = self._ppl_path(corpus, window)
                if path.exists():
                    r = torch.load(path, weights_only=True)
                    out["perplexity"].setdefault(corpus, {})[str(window)] = {
                        "ppl": r["ppl"],
                        "tokens": r["tokens"],
                    }
        path = self._passkey_path()
        if path.exists():
            grid = json.loads(path.read_text())
            out["passkey"] = _passkey_by_length(grid)
            if "recall" in grid:
                out["passkey_recall"] = _passkey_by_length(grid, "recall")
        return out


def _batch(window: int) -> int:
    return max(1, 4096 // window)  # ~4k tokens a forward: bounded logits memory at 2048 as at 256


def _passkey_by_length(grid: dict, metric: str = "accuracy") -> dict:
    return {str(L): sum(row) / len(row) for L, row in zip(grid["lengths"], grid[metric])}


# ------------------------------------------------------------------------------------- evaluation
def evaluate_student(student_dir: Path, reference: TeacherReference, progress: bool = True) -> dict:
    """Every metric of one cell; the student is the only model this loads (the teacher only for
    references not cached yet)."""
    from attn2ssm.student.loading import load_model_and_tokenizer

    s = reference.settings
    start = time.time()
    student, tokenizer = load_model_and_tokenizer(str(student_dir))
    heldout = _heldout(s, tokenizer)
    record: dict = {"perplexity": _perplexity_record(student, reference, heldout, progress)}
    if s.agreement_prompts:
        record["generation_agreement"] = _agreement_record(student, tokenizer, reference, heldout, progress)
    if s.passkey_lengths:
        record["passkey"] = _passkey_record(student, tokenizer, reference, progress)
    if s.suite is not None:
        record["suite"] = suite_record(student, tokenizer, reference, progress)
    del student
    record["eval_seconds"] = time.time() - start
    return record


def _heldout(s: EvalSettings, tokenizer) -> dict:
    """Each corpus's held-out ids (up to ``s.eval_tokens``); a ``DataError`` when one is too short for the windows."""
    from attn2ssm.data import prepare_corpus
    from attn2ssm.errors import DataError

    heldout = {}
    for corpus in s.corpora:
        ids = prepare_corpus(
            corpus, tokenizer, max_heldout_tokens=s.eval_tokens, max_train_tokens=0
        ).heldout_ids[: s.eval_tokens]
        if ids.numel() < max(s.windows) // 2 + 2:
            raise DataError(
                f"corpus {corpus!r} has {ids.numel()} held-out tokens, too few for windows up to {max(s.windows)}",
                "use a larger corpus or smaller --windows",
            )
        heldout[corpus] = ids
    return heldout


def _perplexity_record(student, reference: TeacherReference, heldout: dict, progress: bool) -> dict:
    """Per corpus and window: the student's perplexity beside the teacher's, and their top-1 agreement."""
    from attn2ssm.eval.perplexity import perplexity

    ppl: dict = {}
    for corpus, ids in heldout.items():
        for window in reference.settings.windows:
            teacher = reference.perplexity(corpus, ids, window)
            mine = perplexity(
                student,
                ids,
                window=window,
                stride=window // 2,
                batch_size=_batch(window),
                progress=progress,
                desc=f"student {corpus} @{window}",
                predictions=True,
            )
            ppl.setdefault(corpus, {})[str(window)] = {
                "ppl": mine["ppl"],
                "teacher_ppl": teacher["ppl"],
                "ppl_ratio": mine["ppl"] / teacher["ppl"],
                "tokens": mine["tokens"],
                "top1_agreement": (mine["argmax"] == teacher["argmax"].long()).float().mean().item(),
            }
    return ppl


def _agreement_record(student, tokenizer, reference: TeacherReference, heldout: dict, progress: bool) -> dict:
    """The student's greedy continuations of held-out prompts of the first corpus against the teacher's."""
    from attn2ssm.eval.agreement import generation_agreement, heldout_prompts

    s = reference.settings
    prompts = heldout_prompts(
        heldout[s.corpora[0]], s.agreement_prompts, s.agreement_prompt_len, s.agreement_new_tokens
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    refs = reference.continuations(prompts, pad)
    agree = generation_agreement(
        student, None, prompts, s.agreement_new_tokens, pad_id=pad, progress=progress, references=refs
    )
    record = {
        k: agree[k]
        for k in (
            "token_agreement",
            "prefix_match",
            "rouge_l",
            "forced_agreement",
            "prompts",
            "new_tokens",
        )
    }
    record["corpus"] = s.corpora[0]
    return record


def _passkey_record(student, tokenizer, reference: TeacherReference, progress: bool) -> dict:
    """The student's passkey accuracy and recall by length, beside the teacher's."""
    from attn2ssm.eval.needle import passkey_grid

    s = reference.settings
    teacher_grid = reference.passkey(tokenizer)
    grid = passkey_grid(
        student,
        tokenizer,
        s.passkey_lengths,
        s.passkey_depths,
        s.passkey_trials,
        seed=s.passkey_seed,
        progress=progress,
        desc="student passkey",
    )
    return {
        "accuracy": _passkey_by_length(grid),
        "teacher_accuracy": _passkey_by_length(teacher_grid),
        "mean_accuracy": grid["mean_accuracy"],
        "recall": _passkey_by_length(grid, "recall"),
        "teacher_recall": _passkey_by_length(teacher_grid, "recall"),
        "depths": list(s.passkey_depths),
        "trials": s.passkey_trials,
    }


def suite_record(student, tokenizer, reference: TeacherReference, progress: bool = True) -> dict:
    """A cell's suite: the student's scores of every unit and the table rows beside the teacher's."""
    from attn2ssm.eval.suite import pair_rows, prepare_inputs, score_side

    suite = reference.settings.suite
    inputs = prepare_inputs(suite, tokenizer)
    teacher = reference.suite_scores(tokenizer, inputs)
    reference.release()
    start = time.process_time()
    mine = score_side(student, tokenizer, suite, inputs, None, progress)
    return {
        "settings": suite.as_dict(),
        "rows": pair_rows(suite, teacher, mine),
        "scores": mine,
        "cpu_seconds": time.process_time() - start,
    }


def rescore_suite(cell: Cell, reference: TeacherReference, progress: bool = True) -> dict:
    """Add (or replace) the suite's rows of a cell already scored on everything else: the student is
    loaded and scored on the suite alone; nothing is retrained, the cell's other numbers are kept."""
    from attn2ssm.student.loading import load_model_and_tokenizer

    record = {**read_cell(cell.run_dir), "data": cell.data}  # the same recipe (status "suite")
    student, tokenizer = load_model_and_tokenizer(str(cell.run_dir / "student"))
    try:
        record["suite"] = suite_record(student, tokenizer, reference, progress)
    finally:
        reference.release()
    atomic_write_text(cell.run_dir / "cell.json", json.dumps(record, indent=1) + "\n")
    return record


# ------------------------------------------------------------------------------------- the grid
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


def collect_cells(grid_dir: Path, settings: EvalSettings) -> tuple[list[dict], list[str]]:
    """Every cached cell of the grid scored with ``settings``, and
    the names of cells scored with other settings (left out until they are run again)."""
    records, stale = [], []
    for path in sorted(Path(grid_dir).glob("*/cell.json")):
        rec = read_cell(path.parent)
        if rec is None:
            continue
        if rec.get("eval_settings") != settings.as_dict():
            stale.append(f"{rec['family']}@{rec['tokens']}")
            continue
        records.append(rec)
    return records, stale


def earlier_cells(
    json_path: Path, teacher: str, settings: EvalSettings, have: set[tuple[str, int]]
) -> list[dict]:
    """The cells of the grid JSON at ``json_path`` (written by an earlier invocation, perhaps on
    another machine) that were scored with these settings for this teacher and are not in ``have``
    (family, tokens); each says so in ``"from"``. Nothing from a missing or unreadable file."""
    old = _grid_json(json_path)
    if old.get("teacher") != teacher or old.get("settings") != settings.as_dict():
        return []
    kept = []
    for rec in old.get("cells", []):
        if isinstance(rec, dict) and (rec.get("family"), rec.get("tokens")) not in have:
            kept.append(
                {
                    **rec,
                    "from": rec.get("from")
                    or f"{json_path} (its run directory {rec.get('run_dir')} is not in this grid directory)",
                }
            )
    return kept


def _earlier_suite(json_path: Path, teacher: str) -> dict | None:
    """The suite settings the grid JSON at ``json_path`` was written with for this teacher: an
    invocation with ``--suite none`` scores no cell on the suite but keeps the table of the cells
    scored on it."""
    old = _grid_json(json_path)
    return old.get("suite") if old.get("teacher") == teacher else None


def _grid_json(json_path: Path) -> dict:
    """A grid JSON written earlier (perhaps on another machine); {} when missing or unreadable."""
    try:
        old = json.loads(Path(json_path).read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def write_outputs(
    settings: GridSettings, reference: TeacherReference, command: str, selected: list[str] | None = None
) -> dict:
    from attn2ssm.eval.report import environment

    records, stale = collect_cells(settings.grid_dir, settings.eval)
    records += earlier_cells(
        settings.json_path, settings.teacher, settings.eval, {(r["family"], r["tokens"]) for r in records}
    )
    order = {name: i for i, name in enumerate(settings.families)}  # family-table order, then tokens
    records.sort(key=lambda r: (order.get(r["family"], len(order)), r["family"], r["tokens"]))
    result = {
        "teacher": settings.teacher,
        "grid_dir": str(settings.grid_dir),
        "families": {r["family"]: r["recipe"] for r in records},
        "settings": settings.eval.as_dict(),
        "suite": settings.eval.suite_dict() or _earlier_suite(settings.json_path, settings.teacher),
        "teacher_reference": reference.cached_summary(),
        "cells": [{k: v for k, v in r.items() if k not in ("eval_settings", "recipe_sha")} for r in records],
        "stale_cells": stale,
        "selected": selected or [],
        "command": command,
        "environment": environment(),
    }
    json_path = Path(settings.json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json_path, json.dumps(result, indent=1) + "\n")
    plot_quality(result, json_path.with_suffix(".png"))
    atomic_write_text(json_path.with_suffix(".md"), format_markdown(result) + "\n")
    return result


# ------------------------------------------------------------------------------------- outputs
def _corpus_label(corpus: str) -> str:
    return Path(corpus).name if ("/" in corpus or os.sep in corpus) else corpus


def _tokens_label(n: int) -> str:
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _secs(v) -> str:
    if v is None:
        return "–"
    return f"{v / 3600:.1f} h" if v >= 3600 else f"{v / 60:.1f} min" if v >= 60 else f"{v:.0f} s"


def _passkey_cell(passkey: dict, length: str) -> str:
    """ "accuracy · recall" at one length ("–" where not scored; cells scored before recall show accuracy alone)."""
    acc, recall = passkey.get("accuracy", {}).get(length), passkey.get("recall", {}).get(length)
    if acc is None:
        return "–"
    return f"{acc:.0%}" if recall is None else f"{acc:.0%} · {recall:.0%}"


def _data_cell(data: dict | None) -> str:
    """ "corpus · block length" ("–" for a cell recorded before cells said what they trained on)."""
    return "–" if not data else f"{_corpus_label(data['corpus'])} · {data['block_len']}"


def format_markdown(result: dict) -> str:
    s = result["settings"]
    cols = [(c, str(w)) for c in s["corpora"] for w in s["windows"]]
    lengths = [str(L) for L in s["passkey_lengths"]]
    ref = result["teacher_reference"]
    head = [
        "family",
        "tokens",
        "data",
        *[f"{_corpus_label(c)} @{w}" for c, w in cols],
        "greedy agree",
        *[f"passkey {L}" for L in lengths],
        "wall",
        "train tok/s",
        "command",
    ]
    lines = [
        f"Quality scoreboard: students of `{result['teacher']}`; held-out perplexity over {s['eval_tokens']} tokens per corpus "
        f"(stride = window / 2). Perplexity cells: student ppl · ratio to the teacher · teacher-forced top-1 agreement with the "
        f"teacher on the same windows. Greedy agree: share of {s['agreement_new_tokens']} greedy tokens equal to the teacher's, "
        f"{s['agreement_prompts']} held-out prompts of {_corpus_label(s['corpora'][0])}. Passkey: {len(s['passkey_depths'])} depths × {s['passkey_trials']} keys, "
        f"greedy accuracy · recall (the answer teacher-forced: every digit-bearing token is the argmax; recall without accuracy means the "
        f"key was retrieved but the model answers in another form). Data: the training text · its block length in tokens.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    teacher_cells = [
        f"{ref['perplexity'][c][w]['ppl']:.2f}" if w in ref["perplexity"].get(c, {}) else "–" for c, w in cols
    ]
    passkey_ref = {"accuracy": ref.get("passkey", {}), "recall": ref.get("passkey_recall", {})}
    lines.append(
        "| "
        + " | ".join(
            [
                "teacher",
                "–",
                "–",
                *teacher_cells,
                "100%",
                *[_passkey_cell(passkey_ref, L) for L in lengths],
                "–",
                "–",
                "–",
            ]
        )
        + " |"
    )
    for r in result["cells"]:
        ppl = []
        for c, w in cols:
            p = r["perplexity"].get(c, {}).get(w)
            ppl.append(f"{p['ppl']:.2f} · {p['ppl_ratio']:.2f}× · {p['top1_agreement']:.0%}" if p else "–")
        agree = r.get("generation_agreement", {}).get("token_agreement")
        passkey = r.get("passkey", {})
        tps = r.get("train_tokens_per_s")
        row = [
            r["family"],
            f"{r['tokens']:,}",
            _data_cell(r.get("data")),
            *ppl,
            "–" if agree is None else f"{agree:.0%}",
            *[_passkey_cell(passkey, L) for L in lengths],
            _secs(r.get("wall_seconds")),
            "–" if tps is None else f"{tps:,.0f}",
            "`" + r["command"].replace("|", "\\|") + "`",
        ]
        lines.append("| " + " | ".join(row) + " |")
    if result["stale_cells"]:
        lines += [
            "",
            f"Not shown (scored with other settings; rerun them with --only): {', '.join(result['stale_cells'])}.",
        ]
    if result.get("suite"):
        lines += ["", *format_suite_columns(result)]
    return "\n".join(lines)


def _suite_cells(result: dict) -> list[dict]:
    """The cells scored with the grid's suite (cells scored before it keep "–")."""
    return [r for r in result["cells"] if (r.get("suite") or {}).get("settings") == result.get("suite")]


def format_suite_columns(result: dict) -> list[str]:
    """The suite's summary per cell: student score · recovered (ppl ratio: student / teacher)."""
    from attn2ssm.eval.suite import settings_from_dict, summary

    suite = settings_from_dict(result["suite"])
    scored = {(r["family"], r["tokens"]): r for r in _suite_cells(result)}
    if not scored:
        return [
            f"Suite {suite.name}: no cell scored with it yet (rerun: cached cells are scored on the suite alone, not retrained)."
        ]
    first = next(iter(scored.values()))
    labels = [label for label, _, _ in summary(first["suite"]["rows"], suite)]
    teacher = {label: t for label, t, _ in summary(first["suite"]["rows"], suite)}
    head = ["family", "tokens", "data", *labels, "suite CPU s"]
    lines = [
        f"Suite {suite.name} ({len(suite.tasks)} tasks, needles {len(suite.niah_forms)} forms × {suite.niah_trials} trials per length; "
        f"rows, SEs and n in each cell's cell.json): accuracies in %, student · recovered (student / teacher); the perplexity ratio is "
        f"student / teacher (geometric mean over {', '.join(c for c in suite.corpora if c not in ('sotu', 'moby-dick'))}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| teacher | – | – | "
        + " | ".join(
            "–" if teacher[lb] is None else ("1.00×" if lb.startswith("ppl") else f"{100 * teacher[lb]:.1f}")
            for lb in labels
        )
        + " | – |",
    ]
    unscored = []
    for r in result["cells"]:
        rec = scored.get((r["family"], r["tokens"]))
        if rec is None:
            unscored.append(f"{r['family']}@{r['tokens']:,}")
            continue
        cells = []
        for label, t, st in summary(rec["suite"]["rows"], suite):
            if st is None:
                cells.append("–")
            elif label.startswith("ppl"):
                cells.append(f"{st:.2f}×")
            else:
                cells.append(f"{100 * st:.1f} · " + ("–" if not t else f"{100 * st / t:.0f}%"))
        row = [r["family"], f"{r['tokens']:,}", _data_cell(r.get("data")), *cells]
        lines.append("| " + " | ".join([*row, _secs(rec["suite"].get("cpu_seconds"))]) + " |")
    if unscored:
        lines += [
            "",
            f"Not scored on the suite (rerun the grid with their run directories to score them without retraining, "
            f"or retrain them with --only): {', '.join(unscored)}.",
        ]
    return lines


def plot_quality(result: dict, path: Path) -> Path:
    """Student/teacher perplexity against training tokens, one panel per window (first corpus
    solid, the others dashed), one colour per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    s = result["settings"]
    windows = [str(w) for w in s["windows"]]
    families = list(dict.fromkeys(r["family"] for r in result["cells"]))
    if len({r["tokens"] for r in result["cells"]}) == 1:  # a sweep at one budget: bars, not a curve
        return _plot_sweep(result, families, windows, Path(path), plt)
    suite_cells = _suite_cells(result) if result.get("suite") else []
    panels = len(windows) + (2 if suite_cells else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 4.3), squeeze=False)
    if suite_cells:
        _plot_suite_panels(result, suite_cells, families, axes[0][len(windows) :])
    for ax, window in zip(axes[0], windows):
        for ci, corpus in enumerate(s["corpora"]):
            for fi, family in enumerate(families):
                pts = sorted(
                    (r["tokens"], r["perplexity"][corpus][window]["ppl_ratio"])
                    for r in result["cells"]
                    if r["family"] == family and window in r["perplexity"].get(corpus, {})
                )
                if pts:
                    ax.plot(
                        *zip(*pts),
                        marker="o",
                        color=f"C{fi}",
                        linestyle="-" if ci == 0 else "--",
                        alpha=1.0 if ci == 0 else 0.6,
                        label=family if ci == 0 else None,
                    )
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        budgets = sorted({r["tokens"] for r in result["cells"]})
        if budgets:
            ax.set_xticks(budgets, [_tokens_label(t) for t in budgets])
            ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        low, high = ax.get_ylim()
        shown = (
            "123456789" if high / low < 10 else "25"
        )  # within a decade label every minor tick, else 2s and 5s
        ax.yaxis.set_minor_formatter(
            FuncFormatter(
                lambda v, _, shown=shown: f"{v:.2g}" if f"{v:.2g}".lstrip("0.")[:1] in shown else ""
            )
        )
        ax.set_xlabel("training tokens")
        ax.set_ylabel("held-out ppl / teacher's")
        others = ", ".join(_corpus_label(c) for c in s["corpora"][1:])
        ax.set_title(
            f"window {window}: {_corpus_label(s['corpora'][0])} (solid)"
            + (f", {others} (dashed)" if others else ""),
            fontsize=9,
        )
        ax.grid(alpha=0.3, which="both")
        if families:
            ax.legend(fontsize=8)
    fig.suptitle(f"quality vs budget: students of {result['teacher']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_suite_panels(result: dict, cells: list[dict], families: list[str], axes) -> None:
    """Two panels of the suite against training tokens: the core-task mean and MMLU 5-shot as the
    fraction of the teacher recovered; the needles' mean greedy match at the longest length."""
    from attn2ssm.eval.suite import settings_from_dict, summary

    suite = settings_from_dict(result["suite"])
    budgets = sorted({r["tokens"] for r in result["cells"]})
    styles = {"core avg": "-", "MMLU 5-shot": ":", (suite.generation.label if suite.generation else ""): "--"}
    needle_label, teacher_needle = None, None
    for fi, family in enumerate(families):
        points: dict = {}
        for r in sorted((c for c in cells if c["family"] == family), key=lambda c: c["tokens"]):
            for label, t, st in summary(r["suite"]["rows"], suite):
                if label in styles and t and st is not None:
                    points.setdefault(label, []).append((r["tokens"], st / t))
                elif label.startswith("NIAH") and st is not None:
                    needle_label, teacher_needle = label, t
                    points.setdefault(label, []).append((r["tokens"], st))
        for label, pts in points.items():
            ax = axes[1] if label.startswith("NIAH") else axes[0]
            ax.plot(
                *zip(*pts),
                marker="o",
                color=f"C{fi}",
                linestyle=styles.get(label, "-"),
                label=f"{family}: {label}" if not label.startswith("NIAH") else family,
            )
    axes[0].axhline(1.0, color="gray", linewidth=1)
    axes[0].set_ylabel("student / teacher")
    axes[0].set_title(
        "tasks recovered: " + ", ".join(f"{k} ({v})" for k, v in styles.items() if k), fontsize=8
    )
    if teacher_needle is not None:
        axes[1].axhline(teacher_needle, color="gray", linestyle="--", linewidth=1, label="teacher")
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_ylabel("greedy match")
    axes[1].set_title(f"{needle_label or 'NIAH'}: mean of {', '.join(suite.niah_forms)}", fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        if budgets:
            ax.set_xticks(budgets, [_tokens_label(t) for t in budgets])
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def _plot_sweep(result: dict, families: list[str], windows: list[str], path: Path, plt) -> Path:
    """One budget, several recipe variants: a horizontal bar per family and corpus, one panel per window."""
    s = result["settings"]
    corpora = s["corpora"]
    height = 0.8 / len(corpora)
    fig, axes = plt.subplots(
        1,
        len(windows),
        figsize=(5.6 * len(windows), 1.2 + 0.45 * len(families) * len(corpora)),
        squeeze=False,
    )
    for ax, window in zip(axes[0], windows):
        for ci, corpus in enumerate(corpora):
            ratios = [
                next(
                    (
                        r["perplexity"][corpus][window]["ppl_ratio"]
                        for r in result["cells"]
                        if r["family"] == f and window in r["perplexity"].get(corpus, {})
                    ),
                    float("nan"),
                )
                for f in families
            ]
            ys = [i + ci * height for i in range(len(families))]
            ax.barh(ys, ratios, height=height, color=f"C{ci}", label=_corpus_label(corpus))
            for y, v in zip(ys, ratios):
                if v == v:
                    ax.text(v, y, f" {v:.2f}×", va="center", fontsize=8)
        ax.set_yticks(
            [i + (len(corpora) - 1) * height / 2 for i in range(len(families))], families, fontsize=8
        )
        ax.invert_yaxis()
        finite = [
            r["perplexity"][c][window]["ppl_ratio"]
            for r in result["cells"]
            for c in corpora
            if window in r["perplexity"].get(c, {})
        ]
        if finite and max(finite) / max(min(finite), 1e-9) > 10:  # one bad variant would flatten the rest
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.axvline(1.0, color="gray", linewidth=1)
        ax.set_xlabel("held-out ppl / teacher's")
        ax.set_title(
            f"window {window}, {_tokens_label(result['cells'][0]['tokens'])} training tokens", fontsize=9
        )
        ax.grid(alpha=0.3, axis="x")
        ax.margins(x=0.15)
        if len(corpora) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"recipe sweep: students of {result['teacher']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_plan(cells: list[Cell], settings: EvalSettings) -> str:
    return "\n".join(
        f"{c.name:<28} {c.status(settings):<8} {_data_cell(c.data):<20} stages {c.stage_tokens}  {c.command}"
        for c in cells
    )
