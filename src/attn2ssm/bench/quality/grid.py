"""The grid of ``bench quality``: the family table, token budgets and how one is split over a
recipe's stages, the cells (``Cell``: a family at a budget, its ``distill`` command and run
directory) and their status on disk."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from attn2ssm.errors import ConfigError

if TYPE_CHECKING:
    from attn2ssm.eval.suite_settings import SuiteSettings


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
    # head-level hybrid: 4 of 90 KV groups keep softmax (5 % of the teacher's KV cache)
    "retrieval_heads": "retrieval_heads",
}

DEFAULT_BUDGETS = (2**16, 2**18, 2**20)

DEFAULT_TEACHER = "smollm2-135m"
# The largest budget a cell takes: 2^40 tokens, about a trillion (a cell at a million tokens/s would
# train for 13 days; the distillations this grid compares use 2^16 to 2^30).
MAX_BUDGET = 2**40


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
    # the table (built-in + --family)
    families: dict[str, str] = field(default_factory=lambda: dict(FAMILIES))
    cells: list[tuple[str, int]] = field(default_factory=list)  # (family, tokens) to fill, in order
    # --set overrides: KEY=VALUE for every cell, FAMILY:KEY=VALUE for one family
    sets: list[str] = field(default_factory=list)
    grid_dir: Path = Path("runs/quality")
    json_path: Path = Path("benchmarks/results/quality.json")
    eval: EvalSettings = field(default_factory=EvalSettings)


def parse_tokens(flag: str, text: str) -> int:
    """A token count: ``65536`` or ``2^16`` (``2**16``), from 1 to ``MAX_BUDGET``."""
    t = text.strip().replace("**", "^")
    try:
        base, _, power = t.partition("^")
        value = _power(int(base), int(power)) if "^" in t else int(t)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{flag} {text!r} is not a positive token count", f"write e.g. {flag} 65536,262144 (or 2^16,2^18)"
        )
    if value > MAX_BUDGET:
        raise ConfigError(
            f"{flag} {text!r} is more than the largest budget, 2^40 tokens (a trillion: weeks of training at a million tokens/s)",
            f"write budgets up to 2^40 = {MAX_BUDGET}, e.g. {flag} 65536,262144",
        )
    return value


def _power(base: int, power: int) -> int:
    """``base ** power`` for a token count: 0 (not a count) for a negative power, and just past
    ``MAX_BUDGET`` for one too large to be worth computing (``2^99999999`` would take minutes)."""
    if power < 0:
        return 0
    if base > 1 and power > MAX_BUDGET.bit_length():
        return MAX_BUDGET + 1
    return base**power


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
        # names a run directory
        if not sep or not recipe or not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*", name):
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
            and same_recipe(self)
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
        return "partial" if has_checkpoint(self.run_dir) else "todo"


def _has_every_metric(record: dict, settings: EvalSettings) -> bool:
    """False for a cell scored before a metric was added (passkey recall): it is scored again."""
    return not settings.passkey_lengths or "recall" in record.get("passkey", {})


def has_checkpoint(run_dir: Path) -> bool:
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


def same_recipe(cell: Cell) -> bool:
    """Whether the run directory's saved recipe is the cell's. Both are compared as the current
    loader resolves them, so a key the toolkit added since (with its default) does not turn every
    cached cell of an earlier version into "another recipe"; without a saved recipe, cell.json's
    hash decides. The description is prose, not a setting: a recipe whose text was updated with
    its measured figures still names the same run."""
    import yaml

    from attn2ssm.distill.recipe import load_recipe

    def settings(text: str) -> dict:
        return {k: v for k, v in yaml.safe_load(text).items() if k != "description"}

    saved = cell.run_dir / "recipe.yaml"
    if saved.exists():
        return settings(load_recipe(str(saved)).to_yaml()) == settings(cell.recipe_yaml)
    cached = read_cell(cell.run_dir)
    return not cached or cached.get("recipe_sha") in (None, cell.recipe_sha)
