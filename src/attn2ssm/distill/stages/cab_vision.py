"""CAB's vision half: the joint CAB stage for a ViT/DeiT teacher and a bidirectional
Vision Mamba student, and the two vanilla baselines, as stage kinds of the one trainer.

``vision_cab`` (CAB Algorithm 1): from step 0, per student layer l and each scan direction,
the bridges map the mixer's per-token B and C onto its teacher layer g(l)'s K and Q (Eq. 8; the
backward branch's B, C flipped back to token order by the mixer), plus the softened-logit KL:

    L = align_weight · (L_fw + L_bw) + kl_weight · τ²·KL(p_T^τ ‖ p_S^τ) (+ ce_weight · CE(labels))
    L_dir = (1/L) Σ_l  b_weight·‖φ_B(B_dir^(l)) − K^(g(l))‖² + c_weight·‖φ_C(C_dir^(l)) − Q^(g(l))‖²

The bridges (``cab.Bridges``: Linear → SiLU → Linear, one pair per student layer or one shared
pair) are shared by the two directions, as the paper writes both with the same φ_B, φ_C. K and Q
are the teacher's per-head q/k projections with bias, before the 1/√d scaling; the squared L2
is summed over each head's features and averaged over heads, tokens and layers (``cab.bridge_l2``,
the same reduction as the language stage). ``align_tokens: patches`` leaves the prefix (class /
distillation) tokens out of the alignment; ``all`` (default) aligns them too, class token to class
token (the mixer scans it in the middle, Vim-style, but reports B, C in the teacher's order).
``align_until`` (fraction of the stage's steps, 1.0 = throughout) stops the alignment term early:
App. A.1 stops it at epoch 50 of 300 on full ImageNet, i.e. 0.17.

The baselines ``vision_kd`` and ``vision_ce`` are in vision.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn2ssm.distill.stages.cab import SHARING, Bridges, aligned_layers, attention_bridge_loss
from attn2ssm.distill.stages.vision import ImageStage, softened_kl
from attn2ssm.errors import ConfigError

ALIGN_TOKENS = ("all", "patches")


# --------------------------------------------------------------------------------------------
# losses (pure functions)


def bidirectional_bridge_loss(
    feats: dict,
    targets: dict,
    bridges: Bridges,
    mask: torch.Tensor | None = None,
    b_weight: float = 1.0,
    c_weight: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """L_fw + L_bw (CAB §3.3). ``feats[i]`` = {"fw": (B, C), "bw": (B, C)} of student layer i,
    each (b, l, groups, n) in token order; ``targets[j]`` = (K, Q) of teacher layer j, (b, l, heads, d).
    Returns the loss and its unweighted terms per direction."""
    total, metrics = 0.0, {}
    for direction in ("fw", "bw"):
        b_pairs, c_pairs = [], []
        for i, j in sorted(bridges.pairs.items()):
            (B, C), (K, Q) = feats[i][direction], targets[j]
            phi_B, phi_C = bridges.pair(i)
            b_pairs.append((phi_B(B).unflatten(-1, K.shape[-2:]), K))
            c_pairs.append((phi_C(C).unflatten(-1, Q.shape[-2:]), Q))
        loss, b, c = attention_bridge_loss(b_pairs, c_pairs, mask, b_weight=b_weight, c_weight=c_weight)
        total = total + loss
        metrics[f"align_B_{direction}"], metrics[f"align_C_{direction}"] = b.detach(), c.detach()
    return total, metrics


# --------------------------------------------------------------------------------------------
# what each side computes


def build_vision_bridges(
    student, teacher, *, hidden: int = 0, sharing: str = "per_layer", mode: str = "student"
) -> Bridges:
    """Bridges from each bimamba layer's B, C (d_state wide) to its teacher layer's K, Q (heads·head_dim)."""
    from attn2ssm.adapters import get_adapter

    adapter = get_adapter(teacher)
    pairs = aligned_layers(student, teacher, mode)
    mixers = student.mixers()
    widths = {}
    for i, j in pairs.items():
        m = mixers[i]
        if getattr(m, "mixer_type", None) != "bimamba":
            raise ConfigError(
                f"layer {i} is a '{getattr(m, 'mixer_type', type(m).__name__)}' mixer, not bimamba",
                "use student.mixer: bimamba for vision_cab",
            )
        g = adapter.geometry(teacher.config, j)
        widths[i] = (m.d_state, g.num_kv_heads * g.head_dim, m.d_state, g.num_heads * g.head_dim)
    ref = next(student.parameters())
    return Bridges(pairs, widths, hidden, sharing).to(dtype=ref.dtype, device=ref.device)


@torch.no_grad()
def teacher_qk_and_logits(teacher, pixel_values: torch.Tensor, layers: list[int]):
    """({teacher layer: (K (b, l, kv, d), Q (b, l, h, d))}, logits): q/k projections with bias,
    before the 1/√d scaling, from each attention module's own input (one hooked forward)."""
    from attn2ssm.adapters import get_adapter

    adapter = get_adapter(teacher)
    modules = adapter.attention_modules(teacher)
    inputs, handles = {}, []

    def hook_for(j):
        def hook(module, args, kwargs):
            inputs[j] = args[0] if args else kwargs["hidden_states"]

        return hook

    for j in layers:
        handles.append(modules[j].register_forward_pre_hook(hook_for(j), with_kwargs=True))
    try:
        logits = teacher(pixel_values=pixel_values).logits
    finally:
        for h in handles:
            h.remove()
    out = {}
    for j in layers:
        attn = modules[j]
        q, k, _ = adapter.project_qkv(attn, inputs[j], adapter.layer_geometry(attn))
        out[j] = (k.transpose(1, 2), q.transpose(1, 2))
    return out, logits


def student_bc_and_logits(student, pixel_values: torch.Tensor, layers: list[int]):
    """({student layer: {"fw": (B, C), "bw": (B, C)}}, logits), with gradients: read from each
    mixer's ``bc_tap`` (mixers/bimamba.py) by a forward hook removed afterwards."""
    mixers, captured = student.mixers(), {}

    def hook_for(i):
        def hook(tap, args, output):
            captured[i] = {"fw": args[:2], "bw": args[2:]}  # (B_fw, C_fw, B_bw, C_bw)

        return hook

    handles = [mixers[i].bc_tap.register_forward_hook(hook_for(i)) for i in layers]
    try:
        logits = student(pixel_values=pixel_values).logits
    finally:
        for handle in handles:
            handle.remove()
    return captured, logits


def patch_mask(student, batch: int, length: int, device) -> torch.Tensor:
    """(b, l) with 0 on the prefix (class / distillation) tokens, 1 on patches."""
    k = next(iter(student.mixers().values())).num_prefix_tokens
    m = torch.ones(batch, length, device=device)
    m[:, :k] = 0
    return m


# --------------------------------------------------------------------------------------------
# the stage kind


class VisionCABStage(ImageStage):
    """``vision_cab``: attention-bridge alignment of both scan directions + softened-logit KL,
    jointly from step 0 (CAB, Algorithm 1); see the module docstring for every option."""

    name = "vision_cab"
    through_model_forward = False  # the bridges live outside the student's forward (as in cab.py)
    loss_defaults = {
        "align_weight": 1.0,
        "b_weight": 1.0,
        "c_weight": 1.0,
        "kl_weight": 1.0,
        "ce_weight": 0.0,
        "align_until": 1.0,
        "hidden": 0,
        "bridges": "per_layer",
        "layer_map": "student",
        "align_tokens": "all",
    }
    loss_choices = {
        "bridges": SHARING,
        "layer_map": ("student", "endpoints", "paper"),
        "align_tokens": ALIGN_TOKENS,
    }

    def options(self, cfg) -> dict:
        opts = super().options(cfg)
        hidden = opts["hidden"]
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 0:
            raise ConfigError(
                f"stage '{cfg.name}' ({self.name}): losses.hidden is {hidden!r}",
                "set losses.hidden to a width such as 64, or 0 for each bridge's output width",
            )
        if not 0.0 <= opts["align_until"] <= 1.0:
            raise ConfigError(
                f"stage '{cfg.name}' ({self.name}): losses.align_until is {opts['align_until']}",
                "use a fraction of the stage's steps in [0, 1], e.g. 1.0 (throughout) or 0.17 (App. A.1)",
            )
        return opts

    def stage_modules(self, student, teacher, cfg) -> Bridges:
        opts = self.options(cfg)
        return build_vision_bridges(
            student, teacher, hidden=opts["hidden"], sharing=opts["bridges"], mode=opts["layer_map"]
        )

    def aligning(self, opts: dict, batch: dict) -> bool:
        """Is the alignment term on at this batch's step? (``batch["step"]`` of ``batch["steps"]``)."""
        if opts["align_until"] >= 1.0 or "step" not in batch:
            return opts["align_until"] > 0
        return batch["step"] < opts["align_until"] * batch["steps"]

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        student = getattr(student, "module", student)
        bridges = getattr(student, "stage_modules", None)
        if not isinstance(bridges, Bridges):
            raise ConfigError(
                f"stage '{cfg.name}': the student carries no bridges",
                "run vision_cab stages through the distillation trainer (attn2ssm distill)",
            )
        pixels = batch["pixel_values"]
        align = self.aligning(opts, batch) and opts["align_weight"] > 0
        layers = sorted(bridges.pairs) if align else []
        targets, t_logits = teacher_qk_and_logits(teacher, pixels, sorted({bridges.pairs[i] for i in layers}))
        feats, s_logits = student_bc_and_logits(student, pixels, layers)
        loss, metrics = s_logits.new_zeros(()).float(), {}
        if align:
            some_k = next(iter(targets.values()))[0]
            mask = (
                patch_mask(student, some_k.shape[0], some_k.shape[1], pixels.device)
                if opts["align_tokens"] == "patches"
                else None
            )
            attn, metrics = bidirectional_bridge_loss(
                feats, targets, bridges, mask, opts["b_weight"], opts["c_weight"]
            )
            loss = loss + opts["align_weight"] * attn
            metrics["align"] = attn.detach()
        else:  # keep the bridges in the graph so every process reduces the same parameters
            loss = loss + 0.0 * sum(p.sum() for p in bridges.parameters())
        if opts["kl_weight"]:
            kl = softened_kl(s_logits, t_logits, cfg.temperature)
            loss, metrics["kl"] = loss + opts["kl_weight"] * kl, kl.detach()
        if opts["ce_weight"]:
            ce = F.cross_entropy(s_logits.float(), batch["labels"])
            loss, metrics["ce"] = loss + opts["ce_weight"] * ce, ce.detach()
        return loss, metrics
