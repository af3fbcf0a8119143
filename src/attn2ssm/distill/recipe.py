"""A recipe is data: teacher, corpus, student plan and a list of stages.

This module loads one (a built-in name or a YAML path, with ``--set`` overrides) and resumes a saved
one; the dataclasses are in distill/recipe_schema.py and the checks in distill/recipe_checks.py,
whose public names are reachable from here too. Built-in recipes live in ``attn2ssm/recipes/*.yaml``
(also reachable as ``recipes/`` at the repo root).
"""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path

from attn2ssm.config import apply_overrides, from_dict, load_yaml
from attn2ssm.distill.recipe_checks import TEACHER_DTYPES, check_corpus_given, validate, validate_for_teacher
from attn2ssm.distill.recipe_schema import (
    DATA_FORMATS,
    DataConfig,
    EvalConfig,
    ImageDataConfig,
    LogitCacheConfig,
    LoRAConfig,
    OptimConfig,
    Recipe,
    ScheduleConfig,
    SourceConfig,
    StageConfig,
    StageDataConfig,
    StudentConfig,
)
from attn2ssm.errors import ConfigError

__all__ = [
    "DATA_FORMATS",
    "RECOMPUTING",
    "RESUMABLE",
    "TEACHER_DTYPES",
    "DataConfig",
    "EvalConfig",
    "ImageDataConfig",
    "LoRAConfig",
    "LogitCacheConfig",
    "OptimConfig",
    "Recipe",
    "ScheduleConfig",
    "SourceConfig",
    "StageConfig",
    "StageDataConfig",
    "StudentConfig",
    "builtin_recipe_dir",
    "builtin_recipes",
    "load_recipe",
    "recipe_from_dict",
    "resume_recipe",
    "validate",
    "validate_for_teacher",
]


def builtin_recipe_dir() -> Path:
    return Path(str(resources.files("attn2ssm") / "recipes"))


def builtin_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(builtin_recipe_dir().glob("*.yaml"))}


def load_recipe(name_or_path: str | None = None, overrides: list[str] | None = None) -> Recipe:
    """A built-in recipe name or a YAML path (None → quickstart), with ``--set`` overrides applied."""
    name_or_path = name_or_path or "quickstart"
    recipes = builtin_recipes()
    if name_or_path in recipes:
        raw = load_yaml(recipes[name_or_path])
    elif Path(name_or_path).suffix in (".yaml", ".yml") or Path(name_or_path).exists():
        raw = load_yaml(name_or_path)
    else:
        raise ConfigError(f"no recipe '{name_or_path}'", f"use a YAML path or one of: {', '.join(recipes)}")
    return recipe_from_dict(raw, overrides)


def recipe_from_dict(raw: dict, overrides: list[str] | None = None) -> Recipe:
    """A validated recipe from its dict form (a YAML file's), with ``--set`` overrides applied."""
    raw = apply_overrides(copy.deepcopy(raw), overrides)
    check_corpus_given(raw)
    if raw.get("mixed_precision") is False:  # YAML 1.1 reads a bare `no` as false
        raw["mixed_precision"] = "no"
    recipe = from_dict(Recipe, raw, "recipe")
    validate(recipe)
    return recipe


# What `--set` may change on `--resume`: settings that leave the steps already taken as they were.
# Evaluation and checkpoint cadence touch no weight; device, mixed_precision, teacher_dtype and
# kl_chunk change how the remaining steps compute (a resume on another machine), not what the
# checkpoints hold; gradient_checkpointing only trades memory for time. The rest (budgets, data,
# losses, optimizer, plan, seed, teacher, ...) would make the run follow no recipe.
RESUMABLE = (
    "eval.*",
    "stages.N.save_every",
    "stages.N.keep_checkpoints",
    "stages.N.eval_every",
    "stages.N.eval_batches",
    "stages.N.kl_chunk",
    "stages.N.gradient_checkpointing",
    "device",
    "mixed_precision",
    "teacher_dtype",
    "kernels",
)
_RESUMABLE = re.compile(
    r"^(eval\.\w+|stages\.\d+\.(save_every|keep_checkpoints|eval_every|eval_batches|kl_chunk|gradient_checkpointing)"
    r"|device|mixed_precision|teacher_dtype|kernels)$"
)
# Resume settings after which the remaining steps are no longer bitwise those of an uninterrupted run.
RECOMPUTING = ("device", "mixed_precision", "teacher_dtype", "kl_chunk")


def _leaves(value, prefix: str = "") -> dict:
    """``{"stages.0.tokens": 1000, ...}``: every scalar of a nested dict / list by its --set path."""
    items = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    )
    if items is None:
        return {prefix: value}
    return {
        k: v
        for key, item in items
        for k, v in _leaves(item, f"{prefix}.{key}" if prefix else str(key)).items()
    }


def resume_recipe(
    saved: dict, overrides: list[str] | None
) -> tuple[Recipe, list[tuple[str, object, object]]]:
    """The recipe a run saved, with the ``--set`` overrides of its resume applied, and what they
    change, ``[(key, old, new)]``. An override that would change a key outside ``RESUMABLE`` is a
    ConfigError naming it; one that repeats the saved value changes nothing and passes."""
    before, after = recipe_from_dict(saved), recipe_from_dict(saved, overrides)
    old, new = _leaves(before.to_dict()), _leaves(after.to_dict())
    changed = [key for key in dict.fromkeys([*old, *new]) if old.get(key, "(none)") != new.get(key, "(none)")]
    refused = [key for key in changed if not _RESUMABLE.match(key)]
    if refused:
        raise ConfigError(
            f"--set {refused[0]}={new.get(refused[0], '(none)')!r} would change the recipe of the run being resumed (it has {old.get(refused[0], '(none)')!r})",
            f"drop it to resume, or start a new run in another --out; a resume may change only {', '.join(RESUMABLE)}",
        )
    return after, [(key, old.get(key), new.get(key)) for key in changed]
