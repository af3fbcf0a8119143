"""MOHAWK ("Transformers to SSMs: Distilling Quadratic Knowledge to Subquadratic Models"), stages 1 and 2:
matrix orientation (the mixer's materialised mixing matrix against the teacher's attention) and
hidden-state alignment (the mixer's output against the attention module's). Stage 3 is plain ``kd``."""

from __future__ import annotations

import torch

from attn2ssm.distill.losses import HIDDEN_DISTANCES, MATRIX_NORMS, hidden_distance, matrix_distance
from attn2ssm.distill.stages.base import TeacherForcedStage, mixing_matrix, teacher_forced_output
from attn2ssm.errors import ConfigError


class MatrixOrientationStage(TeacherForcedStage):
    """MOHAWK stage 1, matrix orientation (MOHAWK Eq. 3): per layer, on the teacher's input to
    it, the distance between the student mixer's materialised l × l mixing matrix per head
    (``forward_quadratic``; with its D skip on the diagonal unless ``skip: exclude``) and the
    teacher's attention probabilities, padded rows and columns ignored; mean over sequences and
    heads, then over layers. ``matrix_norm``: ``fro`` (default; the paper's unsquared Frobenius
    norm per head, not normalised by length), ``fro_squared``, or ``row_squared`` (squared error
    per real query row) — see ``losses.matrix_distance``. Only the parameters that shape the
    matrix get gradients (for discrete Mamba-2: B/C (k/q) projections, decay, conv, D)."""

    name = "matrix_orientation"
    loss_defaults = {"matrix_norm": "fro", "skip": "include"}
    loss_choices = {"matrix_norm": MATRIX_NORMS, "skip": ("include", "exclude")}

    def check_mixer(self, i, mixer, opts, cfg):
        if not hasattr(mixer, "forward_quadratic"):
            raise ConfigError(
                f"stage '{cfg.name}' (matrix_orientation): layer {i} is a '{mixer.mixer_type}' mixer, which has no materialised mixing matrix",
                "use a mixer with one (discrete_mamba2, mamba2, linear_attention, hedgemamba), or drop this stage and start with hidden_alignment",
            )

    def layer_loss(self, mixer, io, adapter, mask, opts):
        _, M = mixing_matrix(
            mixer, io.hidden_states, io.position_embeddings, mask, skip=opts["skip"] == "include"
        )
        with torch.no_grad():
            target = adapter.attention_probs(io.module, io.hidden_states, io.position_embeddings, mask)
        dist = matrix_distance(M, target, mask, norm=opts["matrix_norm"])
        return dist, {"matrix": dist.detach()}


class HiddenAlignmentStage(TeacherForcedStage):
    """MOHAWK stage 2, hidden-state alignment (MOHAWK Eq. 4): per layer, on the teacher's input
    to it, the distance between the whole student mixer's output and the teacher attention
    module's output (after its output projection), per real token; mean over layers. Only mixer
    parameters get gradients (recipes set ``trainable: [mixers]``). ``distance``: ``l2`` (default;
    the paper's unsquared per-token L2 norm), ``l2_squared`` or ``mse`` — see
    ``losses.hidden_distance``. The target is the attention sublayer's output, what the paper's
    release aligns when the MLPs stay frozen (not the whole block's output)."""

    name = "hidden_alignment"
    loss_defaults = {"distance": "l2"}
    loss_choices = {"distance": HIDDEN_DISTANCES}

    def layer_loss(self, mixer, io, adapter, mask, opts):
        dist = hidden_distance(teacher_forced_output(mixer, io, mask), io.output, mask, form=opts["distance"])
        return dist, {"hidden": dist.detach()}
