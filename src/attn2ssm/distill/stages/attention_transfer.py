"""Attention transfer — Hedgehog ("The Hedgehog & the Porcupine: Expressive Linear Attentions with
Softmax Mimicry") and LoLCATs, and the first stage of Attention-to-Mamba (HedgeMamba): each mixer,
fed the teacher's own input to its layer, learns to reproduce the teacher's attention weights
and/or output."""

from __future__ import annotations

import torch

from attn2ssm.distill.losses import attention_cross_entropy, output_cosine, output_mse
from attn2ssm.distill.stages.base import TeacherForcedStage, teacher_forced_output
from attn2ssm.errors import ConfigError


class AttentionTransferStage(TeacherForcedStage):
    """Teacher-forced per layer: the mixer sees the teacher's layer input and learns to reproduce
    its attention weights (soft cross-entropy or KL per head, Hedgehog), its attention output
    (MSE, LoLCATs) and/or the output's direction (cosine, HedgeMamba). Losses are averaged over
    layers. Typically only the feature maps train (``trainable: [feature_maps]``). The weight loss
    needs a mixer whose materialised weights are normalised attention (``normalized_weights``)."""

    name = "attention_transfer"
    loss_defaults = {"attention": 1.0, "attention_form": "soft_ce", "output_mse": 0.0, "output_cosine": 0.0}

    def check_mixer(self, i, mixer, opts, cfg):
        if opts["attention"] and not getattr(mixer, "normalized_weights", False):
            raise ConfigError(
                f"stage '{cfg.name}': the attention-weight loss needs normalised weights, but layer {i} is a '{mixer.mixer_type}' mixer",
                "set losses.attention: 0 and align outputs with output_mse / output_cosine",
            )

    def layer_loss(self, mixer, io, adapter, mask, opts):
        if opts["attention"]:
            out, weights = mixer.forward_quadratic(io.hidden_states, io.position_embeddings, mask)
        else:  # output losses only: the ordinary (chunked) forward, no l × l matrix
            out = teacher_forced_output(mixer, io, mask)
        layer, metrics = out.new_zeros((), dtype=torch.float32), {}
        if opts["attention"]:
            with torch.no_grad():
                target = adapter.attention_probs(io.module, io.hidden_states, io.position_embeddings, mask)
            attn = attention_cross_entropy(target, weights, mask, form=opts["attention_form"])
            layer = layer + opts["attention"] * attn
            metrics["attn"] = attn.detach()
        if opts["output_mse"]:
            mse = output_mse(out, io.output, mask)
            layer = layer + opts["output_mse"] * mse
            metrics["mse"] = mse.detach()
        if opts["output_cosine"]:
            cos = output_cosine(out, io.output, mask)
            layer = layer + opts["output_cosine"] * cos
            metrics["cos"] = cos.detach()
        return layer, metrics
