"""Setting a stage up for training: its LoRA adapters and training-only modules, the trainable set,
AdamW and the schedule over its steps (restored on a resume), and accelerate's preparation (DDP,
or FSDP sharding the student in place). Also what a stage's end undoes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from accelerate.utils import DistributedType
from transformers.modeling_layers import GradientCheckpointingLayer

from attn2ssm.distill.checkpoints import name_keyed, set_rng_state
from attn2ssm.distill.lora import attach_lora
from attn2ssm.distill.losses import resolve_kl_chunk
from attn2ssm.distill.schedules import lr_multiplier
from attn2ssm.distill.stages import select_trainable
from attn2ssm.errors import ConfigError


@dataclass
class Prepared:
    """What ``prepare_stage`` returns: the stage's model and optimizer as accelerate prepared them."""

    cfg: object  # the stage's config with its kl_chunk resolved
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    steps: int
    params: list  # FSDP: the sharded ones
    param_names: list[str]  # the trainable parameters' names, in the optimizer's order
    n_trainable_tensors: int
    sharded: bool


def stage_steps(cfg, n_items: int, seq_len: int) -> int:
    """The optimizer steps of a stage: its epochs over its items, or its tokens' worth of batches."""
    if cfg.epochs is not None:
        return max(1, math.ceil(cfg.epochs * n_items / cfg.batch_size))
    return math.ceil(cfg.tokens / (cfg.batch_size * seq_len))


def check_batch_split(cfg, world: int) -> None:
    if cfg.batch_size % (cfg.grad_accum * world):
        raise ConfigError(
            f"stage '{cfg.name}': batch_size {cfg.batch_size} is not divisible by grad_accum × processes = {cfg.grad_accum * world}",
            "make batch_size a multiple of grad_accum × number of processes",
        )


def vocab(student) -> int:
    """The width of the student's logits (its teacher's vocabulary; classes for an image student)."""
    head = student.get_output_embeddings() if hasattr(student, "get_output_embeddings") else None
    return head.weight.shape[0] if head is not None else getattr(student.config, "num_labels", 1)


def activation_checkpointing(model, enable: bool) -> None:
    """HF activation checkpointing of ``model``'s decoder layers, non-reentrant: each layer's forward
    (the mixer inside it too) is recomputed in the backward instead of keeping its activations."""
    if enable:
        # transformers >= 5.2x; older: gradient_checkpointing_enable
        on = getattr(model, "activation_checkpointing_enable", None)
        if on is not None:
            on(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # for reentrant checkpoints only: not needed here
        if getattr(model, "_require_grads_hook", None) is not None:
            model.disable_input_require_grads()
    else:
        off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        off()


# what compile_layers compiles with: torch.compile's default backend (tests swap in a tracing-only one)
COMPILE_BACKEND = "inductor"
RECOMPILE_LIMIT = 64


def decoder_layers(model) -> list[torch.nn.Module]:
    """``model``'s decoder layers (the modules HF's activation checkpointing wraps)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compiled_layers(model, enable: bool) -> None:
    """``torch.compile`` each decoder layer of ``model`` in place (``Module.compile``: the same
    parameters and state-dict names), or undo it. Per layer, so a graph break in one mixer leaves
    the other layers whole; it composes with activation checkpointing, whose wrapper calls the
    compiled layer (and recomputes it compiled). Compiling is lazy: each layer on its first call."""
    if enable:
        # Layers of one class share their forward's code, whose compiled graphs (one a layer form, grad
        # mode and dynamic shape: train and eval, attention and mixer layers) dynamo caches up to
        # this limit (8 by default), running every later one eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in decoder_layers(model):
        if enable:
            layer.compile(backend=COMPILE_BACKEND)
        else:
            layer._compiled_call_impl = None  # what Module.compile set; no public way to undo it


def check_compile(stages, device) -> None:
    """A stage with ``compile_layers`` needs a working ``torch.compile`` on ``device`` (inductor: a C++
    compiler on a CPU, Triton on CUDA): a tiny function compiled and run now, before training starts,
    so a missing toolchain fails in one line instead of at the stage's first step."""
    named = [i for i, stage in enumerate(stages) if getattr(stage, "compile_layers", False)]
    if not named:
        return
    try:
        probe = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend=COMPILE_BACKEND, dynamic=False)
        probe(torch.ones(4, device=device))
    except Exception as exc:  # any toolchain failure: dynamo, inductor, the C++ or Triton compiler
        lines = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
        raise ConfigError(
            f"stages.{named[0]}.compile_layers: torch.compile does not work on {device} ({why})",
            f"set stages.{named[0]}.compile_layers: false (or install what torch.compile needs: a C++ compiler on a CPU, Triton on CUDA)",
        ) from None


def undo_layer_settings(model, cfg) -> None:
    """A stage's end: its activation checkpointing and compiled layers undone (the next stage decides for itself)."""
    if cfg.gradient_checkpointing:
        activation_checkpointing(model, False)
    if cfg.compile_layers:
        compiled_layers(model, False)


def drop_stage_modules(model) -> None:
    """Remove a finished stage's training-only modules (CAB's bridges) from the student."""
    if hasattr(model, "stage_modules"):
        del model.stage_modules


def stage_trainable(unwrapped, cfg, kind, teacher, resume_payload: dict | None) -> list:
    """Attach the stage's LoRA adapters and training-only modules (restored on a resume) and set
    the trainable parameters; returns the names ``select_trainable`` picked."""
    if cfg.lora is not None:
        attach_lora(unwrapped, cfg.lora.targets, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout)
        if resume_payload is not None and "lora" in resume_payload:
            unwrapped.lora.load_state_dict(resume_payload["lora"])
    # attached before the optimizer so a resume finds the same parameter order
    if hasattr(kind, "stage_modules"):
        unwrapped.stage_modules = kind.stage_modules(unwrapped, teacher, cfg)
        if resume_payload is not None and "stage_modules" in resume_payload:
            unwrapped.stage_modules.load_state_dict(resume_payload["stage_modules"])
    names = select_trainable(unwrapped, cfg.trainable, cfg.frozen)
    if hasattr(unwrapped, "stage_modules"):  # they exist only to be trained, whatever the patterns say
        unwrapped.stage_modules.requires_grad_(True)
    return names


def stage_optimizer(params: list, cfg, steps: int, sharded: bool, resume_payload: dict | None, scaler):
    """``(optimizer, scheduler)``: the stage's AdamW and its schedule over its steps, restored from
    ``resume_payload`` (with the RNG and the fp16 loss scale; an FSDP optimizer's state only once
    sharded)."""
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    lam = lr_multiplier(
        cfg.schedule.kind, steps, cfg.schedule.warmup, cfg.schedule.decay, cfg.schedule.min_lr_ratio
    )
    # On the plain optimizer, stepped by the training step only when the optimizer stepped (accelerate's
    # scheduler wrapper would also step it once per process under a multi-process launch).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
    if resume_payload is not None:
        if not sharded:  # FSDP: once the parameters are sharded (prepare_stage_model)
            optimizer.load_state_dict(resume_payload["optimizer"])
        scheduler.load_state_dict(resume_payload["scheduler"])
        set_rng_state(resume_payload["rng"])
        # fp16: the loss scale and its growth count
        if scaler is not None and "scaler" in resume_payload:
            scaler.load_state_dict(resume_payload["scaler"])
    return optimizer, scheduler


def prepare_stage_model(acc, unwrapped, optimizer, cfg, kind, sharded: bool, param_names, resume_payload):
    """``(model, optimizer)`` prepared by accelerate for the stage (an FSDP resume's optimizer
    state loaded into the shards)."""
    # accelerate holds every model and optimizer it prepared until told otherwise, and its
    # clip_grad_norm_ unscales (fp16) the gradients of each optimizer it holds: the last stage's
    # share parameters with this one's, which would be unscaled twice.
    acc.free_memory()
    if kind.through_model_forward:
        # DDP wrap under accelerate launch (identity otherwise), with the optimizer: the GradScaler (fp16)
        # rides on it. Layer-local kinds never call the model's forward, so the model is not wrapped
        # and their gradients are averaged in the training step. FSDP2 shards the student in place.
        activation_checkpointing(unwrapped, cfg.gradient_checkpointing)
        if cfg.compile_layers:  # after the stage's LoRA adapters are attached, before DDP / FSDP wraps
            compiled_layers(unwrapped, True)
        model, optimizer = acc.prepare(unwrapped, optimizer)
    else:
        model, optimizer = unwrapped, acc.prepare_optimizer(optimizer)
    # the full (unsharded) state, each process keeping its shards
    if sharded and resume_payload is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            model,
            optimizer.optimizer,
            name_keyed(resume_payload["optimizer"], param_names),
            options=StateDictOptions(full_state_dict=True),
        )
    return model, optimizer


def prepare_stage(acc, unwrapped, cfg, kind, teacher, n_items: int, seq_len: int, resume_payload) -> Prepared:
    """The stage's adapters / training-only modules, trainable set, optimizer and schedule (restored
    from ``resume_payload`` when the run resumes inside this stage), prepared by accelerate."""
    names = stage_trainable(unwrapped, cfg, kind, teacher, resume_payload)
    params = [p for p in unwrapped.parameters() if p.requires_grad]
    # the same order as params
    param_names = [n for n, p in unwrapped.named_parameters() if p.requires_grad]
    sharded = kind.through_model_forward and acc.distributed_type == DistributedType.FSDP
    steps = stage_steps(cfg, n_items, seq_len)
    optimizer, scheduler = stage_optimizer(params, cfg, steps, sharded, resume_payload, acc.scaler)
    cfg = replace(cfg, kl_chunk=resolve_kl_chunk(cfg.kl_chunk, acc.device.type, vocab(unwrapped)))
    model, optimizer = prepare_stage_model(
        acc, unwrapped, optimizer, cfg, kind, sharded, param_names, resume_payload
    )
    params = [p for group in optimizer.param_groups for p in group["params"]]  # FSDP: the sharded ones
    return Prepared(cfg, model, optimizer, scheduler, steps, params, param_names, len(names), sharded)


def describe_stage(run, n_stages: int, images: bool) -> str:
    """The line a stage starts with: its steps, batch shape and trainable parameters (``run``: its ``StageRun``)."""
    cfg = run.cfg
    if images:
        shape = f"{cfg.batch_size} images"
    elif run.dataset is not None:
        shape = f"{cfg.batch_size} examples (≤ {run.seq_len} tokens)"
    else:
        shape = f"{cfg.batch_size} × {run.seq_len} tokens"
    n_train = sum(p.numel() for p in run.params)
    return (
        f"[stage {run.index + 1}/{n_stages}] {cfg.name} ({cfg.kind}): {run.steps} steps × {shape}, "
        f"{n_train / 1e6:.2f}M trainable params in {run.n_trainable_tensors} tensors"
    )
