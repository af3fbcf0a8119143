"""Language-model kinds on the corpus blocks: ``ce`` (next-token cross-entropy on the data), ``kd``
(forward KL to the frozen teacher's logits) and ``kd_ce`` (both: Mamba in the Llama's stage 1)."""

from __future__ import annotations

import torch

from attn2ssm.distill.losses import cross_entropy, forward_kl, kd_ce_loss
from attn2ssm.distill.stages.base import StageKind


class CrossEntropyStage(StageKind):
    name = "ce"

    def loss(self, student, teacher, batch, cfg):
        logits = student(
            input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False
        ).logits
        loss = cross_entropy(logits, batch["input_ids"], batch.get("attention_mask"))
        return loss, {"ce": loss.detach()}


def teacher_targets(teacher, ids, mask, batch):
    """The teacher's next-token targets for a batch: its logits (one forward), or, when the trainer
    hands the stage a logit cache (``batch["logit_cache"]``, a stage's ``logit_cache`` option), the
    cached top-k + tail targets, computed by the teacher only for blocks the cache has not seen."""
    cache = batch.get("logit_cache")
    if cache is not None:
        return cache.targets(teacher, ids, mask)
    with torch.no_grad():
        return teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits


class KnowledgeDistillationStage(StageKind):
    name = "kd"
    uses_teacher = True
    caches_teacher_logits = True

    def loss(self, student, teacher, batch, cfg):
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        t_logits = teacher_targets(teacher, ids, mask, batch)
        s_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = forward_kl(s_logits, t_logits, mask, temperature=cfg.temperature, chunk_size=cfg.kl_chunk)
        with torch.no_grad():
            ce = cross_entropy(s_logits, ids, mask)
        return loss, {"kl": loss.detach(), "ce": ce.detach()}


class KDCrossEntropyStage(StageKind):
    """Mamba in the Llama's stage 1 (Eq. 2): ``ce_weight·CE + kl_weight·KL(teacher ‖ student)``, α = 1, β = 0.1.

    ``labels: data`` scores the corpus' next tokens; ``labels: teacher`` scores the teacher's
    argmax next token at each position — a cheap per-position stand-in for the paper's
    sequence-level pseudo-labels. Those are the teacher's own sampled replies: generate an SFT
    dataset by sampling the teacher and train on it with kind ``sft`` and ``losses: {kl_weight: 0.1}``.
    """

    name = "kd_ce"
    uses_teacher = True
    caches_teacher_logits = True
    loss_defaults = {"kl_weight": 0.1, "ce_weight": 1.0, "labels": "data"}
    loss_choices = {"labels": ("data", "teacher")}

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        t_logits = teacher_targets(teacher, ids, mask, batch)
        s_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss, ce, kl = kd_ce_loss(
            s_logits,
            t_logits,
            ids,
            mask,
            ce_weight=opts["ce_weight"],
            kl_weight=opts["kl_weight"],
            labels=opts["labels"],
            temperature=cfg.temperature,
            chunk_size=cfg.kl_chunk,
        )
        return loss, {"ce": ce.detach(), "kl": kl.detach()}
