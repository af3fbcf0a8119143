"""Image-classification kinds (CAB's vision half, App. C.1, C.2): the baselines ``vision_kd`` (the
softened-logit KL alone, Hinton) and ``vision_ce`` (cross-entropy on the labels alone: training
from scratch); ``vision_cab`` is in cab_vision.py. Budgets of image stages count images: ``tokens``
is the number of training images seen (the paper's equal sample budget across data fractions),
or ``epochs`` over the stage's (fractional) training set."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn2ssm.distill.losses import forward_kl
from attn2ssm.distill.stages.base import StageKind


def softened_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """τ²·KL(softmax(t/τ) ‖ softmax(s/τ)) averaged over images; logits (b, classes)."""
    return forward_kl(student_logits, teacher_logits, None, temperature=temperature)


class ImageStage(StageKind):
    """Base of the image kinds: they train on the recipe's ``images``, not on corpus blocks."""

    uses_teacher = True
    image_task = True


class VisionCrossEntropyStage(ImageStage):
    """``vision_ce``: cross-entropy on the labels, no teacher (the "vanilla" baseline)."""

    name = "vision_ce"
    uses_teacher = False

    def loss(self, student, teacher, batch, cfg):
        logits = student(pixel_values=batch["pixel_values"]).logits
        loss = F.cross_entropy(logits.float(), batch["labels"])
        return loss, {"ce": loss.detach()}


class VisionKDStage(ImageStage):
    """``vision_kd``: τ²·KL(teacher ‖ student) on softened logits (Hinton's soft distillation),
    plus ``ce_weight``·CE on the labels (0 by default, as the paper's soft-KD baseline)."""

    name = "vision_kd"
    loss_defaults = {"kl_weight": 1.0, "ce_weight": 0.0}

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        with torch.no_grad():
            t_logits = teacher(pixel_values=batch["pixel_values"]).logits
        s_logits = student(pixel_values=batch["pixel_values"]).logits
        kl = softened_kl(s_logits, t_logits, cfg.temperature)
        loss, metrics = opts["kl_weight"] * kl, {"kl": kl.detach()}
        if opts["ce_weight"]:
            ce = F.cross_entropy(s_logits.float(), batch["labels"])
            loss, metrics["ce"] = loss + opts["ce_weight"] * ce, ce.detach()
        return loss, metrics
