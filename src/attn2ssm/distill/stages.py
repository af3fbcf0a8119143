"""Stage kinds: what a stage trains and the loss it minimises.

A stage kind is a small class: ``loss(student, teacher, batch, cfg) -> (loss, metrics)``. End-to-end
kinds here: ``ce`` (next-token cross-entropy on the data) and ``kd`` (forward KL to the frozen
teacher's logits). Layer-local kinds (attention transfer, MOHAWK, …) register the same way.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from attn2ssm.distill.losses import cross_entropy, forward_kl
from attn2ssm.errors import ConfigError


class StageKind:
    name = ""
    uses_teacher = False

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


STAGE_KINDS: dict[str, StageKind] = {k.name: k() for k in (CrossEntropyStage, KnowledgeDistillationStage)}


def select_trainable(student: nn.Module, patterns: list[str]) -> list[str]:
    """Freeze everything, then unfreeze parameters matching any pattern; returns their names.

    Patterns: ``mixers`` (every parameter of a swapped layer's mixer), ``all``, or shell-style
    globs on parameter names such as ``*.mlp.*`` or ``base.model.layers.1?.*``.
    """
    mixer_prefixes = tuple(f"base.{student.config.attention_paths[i]}." for i in student.config.mixer_layers)
    names = [n for n, _ in student.named_parameters()]
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == "all":
            hits = names
        elif pattern == "mixers":
            hits = [n for n in names if n.startswith(mixer_prefixes)]
        else:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            example = names[len(names) // 2] if names else "?"
            raise ConfigError(f"trainable pattern '{pattern}' matches no parameter", f"use 'mixers', 'all' or a glob like '{example}'")
        chosen.update(hits)
    for name, param in student.named_parameters():
        param.requires_grad_(name in chosen)
    return sorted(chosen)
