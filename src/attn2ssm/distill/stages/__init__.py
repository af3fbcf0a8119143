"""Stage kinds: what a stage trains and the loss it minimises.

A stage kind is a small class: ``loss(student, teacher, batch, cfg) -> (loss, metrics)``.
End-to-end kinds call the student like a language model on the corpus blocks: ``ce``
(next-token cross-entropy on the data), ``kd`` (forward KL to the frozen teacher's logits) and
``kd_ce`` (both, Mamba in the Llama's stage 1). Layer-local kinds train each mixer on the teacher's own
input to that layer (teacher forcing, no gradient across layers): ``attention_transfer``
(Hedgehog / LoLCATs / HedgeMamba's stage 1), ``matrix_orientation`` and ``hidden_alignment``
(MOHAWK's stages 1 and 2). Dataset kinds read the stage's own ``data``:
``sft`` (cross-entropy on assistant tokens of chat data) and ``dpo`` (preference pairs, the
teacher as the reference policy, Mamba in the Llama's stage 3). Kind-specific loss settings live in the
stage's ``losses`` mapping; unknown keys are errors.
"""

from attn2ssm.distill.stages.attention_transfer import AttentionTransferStage
from attn2ssm.distill.stages.base import StageKind, select_trainable
from attn2ssm.distill.stages.cab import BridgeAlignmentStage
from attn2ssm.distill.stages.cab_vision import VisionCABStage
from attn2ssm.distill.stages.chat import DPOStage, SFTStage
from attn2ssm.distill.stages.lm import CrossEntropyStage, KDCrossEntropyStage, KnowledgeDistillationStage
from attn2ssm.distill.stages.mohawk import HiddenAlignmentStage, MatrixOrientationStage
from attn2ssm.distill.stages.vision import VisionCrossEntropyStage, VisionKDStage

STAGE_KINDS: dict[str, StageKind] = {
    k.name: k()
    for k in (
        CrossEntropyStage,
        KnowledgeDistillationStage,
        KDCrossEntropyStage,
        AttentionTransferStage,
        SFTStage,
        DPOStage,
        MatrixOrientationStage,
        HiddenAlignmentStage,
        BridgeAlignmentStage,
        VisionCrossEntropyStage,
        VisionKDStage,
        VisionCABStage,
    )
}

__all__ = ["STAGE_KINDS", "StageKind", "select_trainable"]
