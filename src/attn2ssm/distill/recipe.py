"""A recipe is data: teacher, corpus, student plan and a list of stages.

Every field has a default, so ``Recipe()`` is a valid (if short) run; built-in recipes live in
``attn2ssm/recipes/*.yaml`` (also reachable as ``recipes/`` at the repo root).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from attn2ssm.config import apply_overrides, from_dict, load_yaml
from attn2ssm.errors import ConfigError


@dataclass
class DataConfig:
    corpus: str = "sotu"  # built-in name, local file/dir, or hf:<name>[:<config>][:<split>]
    block_len: int = 256
    max_train_tokens: int | None = None
    max_heldout_tokens: int | None = 20000
    text_field: str = "text"


@dataclass
class StudentConfig:
    mixer: str = "linear_attention"
    mixer_options: dict = field(default_factory=dict)
    attention_ratio: float = 0.0  # fraction of layers that keep softmax attention, evenly interleaved
    keep_attention: list[int] | None = None  # explicit layer indices; overrides attention_ratio


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class ScheduleConfig:
    kind: str = "warmup_cosine"  # warmup_cosine | wsd (warmup-stable-decay) | constant
    warmup: float = 0.05  # fraction of the stage's steps (or steps, if >= 1)
    decay: float = 0.2  # wsd: fraction of steps in the final decay
    min_lr_ratio: float = 0.1


@dataclass
class LoRAConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class StageConfig:
    name: str = "stage"
    kind: str = "kd"
    tokens: int = 100_000  # token budget: steps = ceil(tokens / (batch_size * block_len))
    trainable: list[str] = field(default_factory=lambda: ["mixers"])  # 'mixers', 'feature_maps', 'all' or globs
    batch_size: int = 8  # sequences per optimizer step, over all processes
    grad_accum: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    clip: float = 1.0
    temperature: float = 1.0  # kd
    kl_chunk: int = 64  # kd: tokens per chunk of the vocabulary-wide KL (small chunks stay in cache)
    lora: LoRAConfig | None = None  # adapters on `targets`, trained via the 'lora' pattern, merged at the stage end
    losses: dict = field(default_factory=dict)  # kind-specific loss weights/options (see the stage kind)
    eval_every: int = 0  # steps between held-out evaluations (0: stage end only)
    eval_batches: int = 4
    save_every: int = 50  # steps between checkpoints (the stage end always saves)
    keep_checkpoints: int = 2


@dataclass
class EvalConfig:
    max_tokens: int = 20000  # held-out tokens scored for perplexity
    window: int | None = None  # defaults to data.block_len
    stride: int | None = None  # defaults to window // 2
    batch_size: int = 4


@dataclass
class Recipe:
    name: str = "custom"
    description: str = ""
    teacher: str = "smollm2-135m"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    data: DataConfig = field(default_factory=DataConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


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
    recipe = from_dict(Recipe, apply_overrides(raw, overrides), "recipe")
    validate(recipe)
    return recipe


def validate(recipe: Recipe) -> None:
    from attn2ssm.distill.stages import STAGE_KINDS

    if not recipe.stages:
        raise ConfigError("the recipe has no stages", "add at least one entry under 'stages'")
    for i, stage in enumerate(recipe.stages):
        where = f"stages[{i}] ({stage.name})"
        if stage.kind not in STAGE_KINDS:
            raise ConfigError(f"{where}: unknown kind '{stage.kind}'", f"use one of: {', '.join(STAGE_KINDS)}")
        STAGE_KINDS[stage.kind].options(stage)  # unknown `losses` keys fail here, before any loading
        if stage.schedule.kind not in ("warmup_cosine", "wsd", "constant"):
            raise ConfigError(f"{where}: unknown schedule '{stage.schedule.kind}'", "use warmup_cosine, wsd or constant")
        if stage.tokens <= 0 or stage.batch_size <= 0 or stage.grad_accum <= 0:
            raise ConfigError(f"{where}: tokens, batch_size and grad_accum must be positive", "fix the stage's budget")
        if stage.batch_size % stage.grad_accum:
            raise ConfigError(f"{where}: batch_size {stage.batch_size} is not divisible by grad_accum {stage.grad_accum}", "make batch_size a multiple of grad_accum")
    if recipe.data.block_len < 2:
        raise ConfigError("data.block_len must be at least 2", "set data.block_len=256 for example")
