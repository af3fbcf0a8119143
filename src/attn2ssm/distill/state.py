"""The state the distillation loop carries: the run's position (``TrainerState``, saved in every
checkpoint's state.json), what one stage holds while it runs (``StageRun``) and what one optimizer
step reports (``StepResult``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from attn2ssm.distill.recipe import StageConfig
from attn2ssm.distill.stages import StageKind


class StepResult(NamedTuple):
    """What one optimizer step reports (``Distiller._train_step``)."""

    tokens: int  # tokens of the global batch
    loss: float  # averaged over micro-batches and processes
    metrics: dict  # the stage kind's metrics, averaged the same way
    grad_norm: float | None  # before clipping (None: the stage does not clip)
    skipped: bool = False  # fp16: the gradients overflowed, so neither the optimizer nor the schedule stepped
    stop: int | None = None  # several processes: the signal they agreed to stop on after this step (0: none)


@dataclass
class TrainerState:
    stage: int = 0  # index of the stage in progress
    step: int = 0  # optimizer steps completed in that stage
    tokens: int = 0  # tokens consumed in that stage
    total_tokens: int = 0  # tokens consumed over all stages
    finished: list[int] = field(default_factory=list)  # indices of completed stages

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.tokens += tokens
        self.total_tokens += tokens


@dataclass
class StageRun:
    """What one stage holds while it runs (``Distiller._setup_stage`` builds it with ``stage_setup``)."""

    index: int
    cfg: StageConfig
    kind: StageKind
    dataset: object | None  # the stage's own dataset (sft / dpo), else None: corpus blocks
    seq_len: int
    n_items: int  # blocks or dataset examples the stage draws from
    steps: int
    # DDP-wrapped (FSDP: sharded in place) when the kind runs through the model's forward
    model: torch.nn.Module
    unwrapped: torch.nn.Module
    params: list
    n_trainable_tensors: int
    optimizer: torch.optim.Optimizer  # accelerate's AcceleratedOptimizer (fp16: with the GradScaler)
    scheduler: torch.optim.lr_scheduler.LambdaLR  # on the plain optimizer, stepped only when it stepped
    logit_cache: object | None = None  # the stage's LogitCache (its `logit_cache` option), else None
    # the trainable parameters' names, in the optimizer's order
    param_names: list[str] = field(default_factory=list)
    sharded: bool = False  # FSDP: the student is sharded across processes for this stage
