"""Stage kinds: what a stage trains and the loss it minimises.

A stage kind is a small class: ``loss(student, teacher, batch, cfg) -> (loss, metrics)``.
End-to-end kinds call the student like a language model: ``ce`` (next-token cross-entropy on
the data) and ``kd`` (forward KL to the frozen teacher's logits). Layer-local kinds train each
mixer on the teacher's own input to that layer (teacher forcing, no gradient across layers):
``attention_transfer`` (paper 002 / LoLCATs / paper 000's stage 1). Kind-specific loss settings
live in the stage's ``losses`` mapping; unknown keys are errors.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from attn2ssm.distill.losses import attention_cross_entropy, cross_entropy, forward_kl, output_cosine, output_mse
from attn2ssm.errors import ConfigError


class StageKind:
    name = ""
    uses_teacher = False
    # False for layer-local kinds: they never call the student's forward, so the trainer does not
    # wrap it in DDP and averages gradients across processes itself.
    through_model_forward = True
    loss_defaults: dict = {}

    def options(self, cfg) -> dict:
        unknown = sorted(set(cfg.losses) - set(self.loss_defaults))
        if unknown:
            valid = ", ".join(self.loss_defaults) or "(none)"
            raise ConfigError(f"stage '{cfg.name}' ({self.name}): unknown losses key(s) {', '.join(unknown)}", f"valid keys: {valid}")
        return {**self.loss_defaults, **cfg.losses}

    def loss(self, student, teacher, batch: dict, cfg) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError


class CrossEntropyStage(StageKind):
    name = "ce"

    def loss(self, student, teacher, batch, cfg):
        logits = student(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
        loss = cross_entropy(logits, batch["input_ids"], batch.get("attention_mask"))
        return loss, {"ce": loss.item()}


class KnowledgeDistillationStage(StageKind):
    name = "kd"
    uses_teacher = True

    def loss(self, student, teacher, batch, cfg):
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits
        s_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = forward_kl(s_logits, t_logits, mask, temperature=cfg.temperature, chunk_size=cfg.kl_chunk)
        with torch.no_grad():
            ce = cross_entropy(s_logits, ids, mask)
        return loss, {"kl": loss.item(), "ce": ce.item()}


class AttentionTransferStage(StageKind):
    """Teacher-forced per layer: the mixer sees the teacher's layer input and learns to reproduce
    its attention weights (soft cross-entropy or KL per head, paper 002), its attention output
    (MSE, LoLCATs) and/or the output's direction (cosine, paper 000). Losses are averaged over
    layers. Typically only the feature maps train (``trainable: [feature_maps]``)."""

    name = "attention_transfer"
    uses_teacher = True
    through_model_forward = False
    loss_defaults = {"attention": 1.0, "attention_form": "soft_ce", "output_mse": 0.0, "output_cosine": 0.0}

    def loss(self, student, teacher, batch, cfg):
        from attn2ssm.adapters import get_adapter
        from attn2ssm.distill.teacher_forcing import capture_attention_io

        opts = self.options(cfg)
        student = getattr(student, "module", student)
        mixers = student.mixers()
        if not mixers:
            raise ConfigError(f"stage '{cfg.name}': the student has no mixer layers to transfer to", "convert at least one layer")
        mask = batch.get("attention_mask")
        io = capture_attention_io(teacher, batch["input_ids"], sorted(mixers), mask)
        adapter = get_adapter(teacher)
        total, sums = 0.0, {"attn": 0.0, "mse": 0.0, "cos": 0.0}
        for i, mixer in mixers.items():
            x = io[i]
            out, weights = mixer.forward_quadratic(x.hidden_states, x.position_embeddings, mask)
            layer = out.new_zeros((), dtype=torch.float32)
            if opts["attention"]:
                with torch.no_grad():
                    target = adapter.attention_probs(x.module, x.hidden_states, x.position_embeddings, mask)
                attn = attention_cross_entropy(target, weights, mask, form=opts["attention_form"])
                layer = layer + opts["attention"] * attn
                sums["attn"] += attn.item()
            if opts["output_mse"]:
                mse = output_mse(out, x.output, mask)
                layer = layer + opts["output_mse"] * mse
                sums["mse"] += mse.item()
            if opts["output_cosine"]:
                cos = output_cosine(out, x.output, mask)
                layer = layer + opts["output_cosine"] * cos
                sums["cos"] += cos.item()
            total = total + layer
        n = len(mixers)
        metrics = {k: v / n for k, v in sums.items() if v}
        return total / n, metrics


STAGE_KINDS: dict[str, StageKind] = {k.name: k() for k in (CrossEntropyStage, KnowledgeDistillationStage, AttentionTransferStage)}


def select_trainable(student: nn.Module, patterns: list[str]) -> list[str]:
    """Freeze everything, then unfreeze parameters matching any pattern; returns their names.

    Patterns: ``mixers`` (every parameter of a swapped layer's mixer), ``feature_maps`` (the
    mixers' feature-map parameters and sliding-window mixing factors only), ``lora`` (the stage's adapters), ``all``, or shell-style globs on parameter names such
    as ``*.mlp.*`` or ``base.model.layers.1?.*``.
    """
    mixer_prefixes = tuple(f"base.{student.config.attention_paths[i]}." for i in student.config.mixer_layers)
    names = [n for n, _ in student.named_parameters()]
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == "all":
            hits = names
        elif pattern == "mixers":
            hits = [n for n in names if n.startswith(mixer_prefixes)]
        elif pattern == "lora":
            hits = [n for n in names if n.startswith("lora.")]
        elif pattern == "feature_maps":
            hits = [n for n in names if n.startswith(mixer_prefixes) and (".feature_map_" in n or n.endswith(".window_factor"))]
        else:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            example = names[len(names) // 2] if names else "?"
            raise ConfigError(f"trainable pattern '{pattern}' matches no parameter", f"use 'mixers', 'all' or a glob like '{example}'")
        chosen.update(hits)
    for name, param in student.named_parameters():
        param.requires_grad_(name in chosen)
    return sorted(chosen)
