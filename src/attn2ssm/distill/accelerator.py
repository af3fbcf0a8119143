"""A run's compute setup, decided once before anything loads: the device, the kernels, the mixed
precision, accelerate's ``Accelerator`` (one process or many, DDP or FSDP) and the teacher's dtype."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

from attn2ssm.distill.recipe import Recipe
from attn2ssm.distill.stage_setup import check_compile
from attn2ssm.distill.stages import STAGE_KINDS
from attn2ssm.errors import ConfigError
from attn2ssm.ops.kernels import choose_kernels
from attn2ssm.precision import choose_precision, warn_if_slow_bf16


@dataclass
class RunSetup:
    """What ``setup_accelerator`` decided."""

    acc: Accelerator
    kernels: object  # ops.kernels' choice: .used, .describe(), .to_dict()
    precision: object  # precision's choice: .used, .describe(), .to_dict()
    teacher_dtype: torch.dtype | None  # None: a teacher passed in keeps its own


def resolve_teacher_dtype(requested: str, device_type: str, precision_used: str) -> torch.dtype:
    """``teacher_dtype``: auto = the mixed precision's dtype on CUDA (float32 under ``no``), float32 elsewhere."""
    if requested == "auto":
        requested = (
            {"bf16": "bfloat16", "fp16": "float16"}.get(precision_used, "float32")
            if device_type == "cuda"
            else "float32"
        )
    return getattr(torch, requested)


def _select_gpu(device: str) -> None:
    """``device: cuda:N`` in one process: make GPU N the current one before accelerate picks it (under
    ``accelerate launch`` each process takes the GPU of its local rank, and cuda:N is refused)."""
    if not device.startswith("cuda:"):
        return
    index = int(device.split(":")[1])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"device={device} names one GPU, and this run has several processes",
            "use device: cuda (each process takes its own GPU)",
        )
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise ConfigError(
            f"device={device}: this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA devices",
            "use device: auto, or an index below the device count",
        )
    torch.cuda.set_device(index)


def _cpu_fp16(acc: Accelerator) -> None:
    """accelerate gives fp16 on a CPU neither autocast nor a GradScaler: the run would be fp32 while
    saying fp16. torch has both for the CPU, so they are installed where accelerate installs them on
    CUDA: the same loss scaling, unscaling before clipping and skipped overflow steps run on a CPU
    (slowly: it is there to check the fp16 path, e.g. in the tests)."""
    if acc.mixed_precision == "fp16" and acc.device.type == "cpu" and acc.scaler is None:
        acc.scaler = torch.amp.GradScaler("cpu")
        # accelerate's autocast() and unscale_gradients() follow this flag
        acc.native_amp = True


def _release_accelerate_state(mixed_precision: str) -> None:
    """accelerate keeps one state per process and refuses an ``Accelerator`` with another precision;
    a single process may run several recipes (a sweep, a notebook, bench train), so there the old
    state is let go. Under a distributed launch the launcher's state stays."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or not AcceleratorState._shared_state:
        return
    if AcceleratorState._shared_state.get("_mixed_precision") != mixed_precision:
        AcceleratorState._reset_state()


def check_teacher_dtype(recipe: Recipe, teacher_dtype: torch.dtype | None, precision_used: str) -> None:
    """Layer-local kinds and CAB's bridges feed the teacher's activations to fp32 student modules:
    a teacher in a reduced dtype needs autocast (mixed precision) to meet them there."""
    if teacher_dtype in (None, torch.float32) or precision_used != "no":
        return
    name = str(teacher_dtype).removeprefix("torch.")
    for i, cfg in enumerate(recipe.stages):
        if not STAGE_KINDS[cfg.kind].through_model_forward:
            raise ConfigError(
                f"stages[{i}] ({cfg.name}): a {name} teacher without mixed precision hands its {name} activations to the fp32 student modules of kind '{cfg.kind}'",
                "set mixed_precision: bf16 (autocast meets them), or teacher_dtype: float32",
            )


def _check_fsdp(acc: Accelerator, recipe: Recipe, precision_used: str) -> None:
    """What FSDP refuses; and the FSDP config on a CPU, which accelerate runs as plain data parallel
    (it shards only on GPUs), said in one line."""
    if acc.distributed_type == DistributedType.FSDP:
        # accelerate's FSDP clip unscales a trainable subset twice
        if precision_used == "fp16":
            raise ConfigError(
                "mixed_precision fp16 under FSDP is not supported by this trainer",
                "use mixed_precision: bf16 (or auto) with configs/accelerate/fsdp.yaml",
            )
        if recipe.images is not None:
            raise ConfigError(
                "image recipes do not run under FSDP",
                "launch them without --config_file configs/accelerate/fsdp.yaml (their students are small)",
            )
    elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true") and acc.is_main_process:
        print(
            f"notice: the FSDP config does not shard on {acc.device.type.upper()}: accelerate runs its "
            f"{acc.num_processes} process(es) as plain data parallel, each holding the whole student and optimizer",
            file=sys.stderr,
        )


def setup_accelerator(recipe: Recipe, teacher_passed: bool) -> RunSetup:
    """Device, kernels, precision, the accelerator and the teacher's dtype (a teacher passed in
    keeps its own: bench train reuses one across precisions)."""
    device = (
        "cpu"
        if recipe.device == "cpu" or (recipe.device == "auto" and not torch.cuda.is_available())
        else "cuda"
    )
    _select_gpu(recipe.device)
    kernels = choose_kernels(recipe.kernels, device)  # once per run (ops/kernels.py)
    # auto: bf16 only where it is fast (CUDA with bf16, a CPU with native bf16); explicit bf16 on a slow CPU warns
    precision = choose_precision(recipe.mixed_precision, device)
    if precision.used == "bf16":
        warn_if_slow_bf16(
            device,
            "mixed_precision: bf16",
            "training will be that much slower: set mixed_precision: auto (or no)",
        )
    _release_accelerate_state(precision.used)
    acc = Accelerator(cpu=device == "cpu", mixed_precision=precision.used)
    _cpu_fp16(acc)
    teacher_dtype = (
        None if teacher_passed else resolve_teacher_dtype(recipe.teacher_dtype, device, precision.used)
    )
    check_teacher_dtype(recipe, teacher_dtype, precision.used)
    _check_fsdp(acc, recipe, precision.used)
    # compile_layers: torch.compile works here, before anything loads
    check_compile(recipe.stages, acc.device)
    return RunSetup(acc, kernels, precision, teacher_dtype)
