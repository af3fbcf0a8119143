"""CAB: attention bridges from a Mamba student's B and C to the teacher's K and Q.

With the decay Ā ≈ I a Mamba layer is linear attention (CAB, Eq. 5): B writes into the
state as a key does and C reads it out as a query does. So instead of matching L×L attention
matrices (MOHAWK), CAB aligns them per token through two small MLPs per student layer,
φ_B, φ_C: Linear → SiLU → Linear, trained with the student and thrown away afterwards (Eq. 8):

    L_attn = (1/L) Σ_l  ‖φ_B(B^(l)) − K^(g(l))‖² + ‖φ_C(C^(l)) − Q^(g(l))‖²

g is the proportional layer map (``student.plans.layer_map``; a student of another depth
records the teacher layer each of its layers was built from, and that is the default pairing).

Choices where the paper is silent (stage ``losses`` options; see ``BridgeAlignmentStage``):

* B and C are what the scan reads: Mamba-2 after the conv (and its SiLU), before Δ — the
  continuous-time B, C of the paper (L202) — B at its kv width (before the GQA repeat), C with
  the 1/√d the mixer folds in. K and Q are the teacher's per-head projections after its q/k
  norms, before the 1/√d scaling and (``targets: pre_rope``, default) before RoPE: a student
  without RoPE cannot produce rotated vectors; ``post_rope`` aligns to what the teacher scores.
* One MLP pair per student layer (``bridges: per_layer``) or one for all (``shared``), each
  over all heads at once (B ∈ R^{N×d_s} in the paper), hidden width = its output width unless
  ``hidden`` says otherwise.
* ‖·‖² is summed over each head's features and averaged over heads, real tokens and aligned
  layers (``F.mse_loss`` would also divide by head_dim); ``b_weight``/``c_weight`` give the
  B-only / C-only ablations, ``kl_weight``/``ce_weight`` the joint alignment + KD of the
  paper's vision recipe (its language recipe aligns alone, then a ``kd`` stage follows).

The bridges are training-only: the trainer attaches what ``stage_modules`` returns to the
student as ``student.stage_modules`` for the stage, trains and checkpoints it beside (never
inside) the student, and drops it when the stage ends.
"""

from __future__ import annotations

import torch
from torch import nn

from attn2ssm.distill.losses import cross_entropy, forward_kl
from attn2ssm.distill.stages.base import StageKind
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.taps import Tap
from attn2ssm.student.plans import LAYER_MAPS, layer_map

TARGETS = ("pre_rope", "post_rope")
SHARING = ("per_layer", "shared")


# --------------------------------------------------------------------------------------------
# losses (pure functions)


def bridge_l2(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """‖pred − target‖² per token and head, averaged over heads and real tokens.

    pred, target: (b, l, heads, d); mask: (b, l), 1 = real token.
    """
    per_token = (pred.float() - target.float()).pow(2).sum(-1).mean(-1)  # (b, l)
    m = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1)


def attention_bridge_loss(
    b_pairs: list[tuple[torch.Tensor, torch.Tensor]],
    c_pairs: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor | None = None,
    *,
    b_weight: float = 1.0,
    c_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CAB's Eq. 8: the mean over aligned layers of b_weight·‖φ_B(B) − K‖² + c_weight·‖φ_C(C) − Q‖².

    ``b_pairs[l]`` = (φ_B(B), K) and ``c_pairs[l]`` = (φ_C(C), Q) of layer l, each (b, l, heads, d).
    Returns ``(loss, mean B term, mean C term)`` (the terms unweighted).
    """
    if not b_pairs or len(b_pairs) != len(c_pairs):
        raise ValueError(f"need one (B, C) pair per aligned layer, got {len(b_pairs)} B and {len(c_pairs)} C")
    b = torch.stack([bridge_l2(p, t, mask) for p, t in b_pairs]).mean()
    c = torch.stack([bridge_l2(p, t, mask) for p, t in c_pairs]).mean()
    return b_weight * b + c_weight * c, b, c


# --------------------------------------------------------------------------------------------
# the bridges


class Bridge(nn.Module):
    """φ: Linear(d_in → hidden) → SiLU → Linear(hidden → d_out), per token (CAB, L250)."""

    def __init__(self, d_in: int, d_out: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.SiLU(), nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, l, heads_in, d_in_head) → (b, l, d_out) with heads concatenated."""
        return self.net(x.flatten(2))


class Bridges(nn.Module):
    """φ_B and φ_C for each aligned student layer (or one pair for all), and the layer pairing.

    ``pairs``: student layer → teacher layer. ``widths``: student layer → (B in, K out, C in, Q out).
    """

    def __init__(
        self,
        pairs: dict[int, int],
        widths: dict[int, tuple[int, int, int, int]],
        hidden: int = 0,
        sharing: str = "per_layer",
    ):
        super().__init__()
        self.pairs = dict(pairs)
        keys = {i: ("all" if sharing == "shared" else str(i)) for i in pairs}
        if sharing == "shared" and len(set(widths.values())) > 1:
            raise ConfigError(
                "bridges: shared needs every aligned layer to have the same B/C and K/Q widths",
                "use bridges: per_layer",
            )
        self.key_of = keys
        self.phi_B, self.phi_C = nn.ModuleDict(), nn.ModuleDict()
        for i, key in keys.items():
            if key in self.phi_B:
                continue
            b_in, k_out, c_in, q_out = widths[i]
            self.phi_B[key] = Bridge(b_in, k_out, hidden or k_out)
            self.phi_C[key] = Bridge(c_in, q_out, hidden or q_out)

    def pair(self, layer: int) -> tuple[Bridge, Bridge]:
        return self.phi_B[self.key_of[layer]], self.phi_C[self.key_of[layer]]


def aligned_layers(student, teacher, mode: str = "student") -> dict[int, int]:
    """Student mixer layer → teacher layer it is aligned to.

    ``mode="student"``: the teacher layer each student layer was built from (``config.teacher_layers``;
    layer i ← layer i at equal depth); ``"endpoints"`` / ``"paper"``: ``layer_map`` recomputed.
    """
    n_student, n_teacher = len(student.config.layer_plan), teacher.config.num_hidden_layers
    source = student.config.teacher_layers
    if mode != "student" or (source is None and n_student != n_teacher):
        source = layer_map(n_student, n_teacher, "endpoints" if mode == "student" else mode)
    elif source is None:
        source = list(range(n_student))
    return {i: source[i] for i in student.config.mixer_layers}


def build_bridges(
    student, teacher, *, hidden: int = 0, sharing: str = "per_layer", mode: str = "student"
) -> Bridges:
    """Fresh bridges for ``student``'s mixer layers, in the student's dtype and device."""
    from attn2ssm.adapters import get_adapter

    adapter = get_adapter(teacher)
    pairs = aligned_layers(student, teacher, mode)
    mixers = student.mixers()
    if not pairs:
        raise ConfigError(
            "the student has no mixer layers to align",
            "convert at least one layer to mamba2, discrete_mamba2 or mamba",
        )
    widths = {}
    for i, j in pairs.items():
        m = mixers[i]
        if not isinstance(getattr(m, "bc_tap", None), Tap):
            raise ConfigError(
                f"layer {i} is a '{m.mixer_type}' mixer, which has no per-token B and C to align",
                "use mamba2, discrete_mamba2 or mamba for a bridge_alignment stage",
            )
        g = adapter.geometry(teacher.config, j)
        widths[i] = (
            m.num_kv_heads * m.head_dim,
            g.num_kv_heads * g.head_dim,
            m.num_heads * m.head_dim,
            g.num_heads * g.head_dim,
        )
    ref = next(student.parameters())
    return Bridges(pairs, widths, hidden, sharing).to(dtype=ref.dtype, device=ref.device)


# --------------------------------------------------------------------------------------------
# what each side computes


class _Stop(Exception):
    pass


def teacher_qk(
    adapter, attn: nn.Module, hidden_states: torch.Tensor, position_embeddings, rope: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher layer's K (b, l, kv, d) and Q (b, l, h, d): after q/k norms, before 1/√d; RoPE if ``rope``."""
    if rope:
        q, k = adapter.qk(attn, hidden_states, position_embeddings)
    else:
        q, k, _ = adapter.project_qkv(attn, hidden_states, adapter.layer_geometry(attn))
        q_norm, k_norm = adapter.qk_norms(attn)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
    return k.transpose(1, 2), q.transpose(1, 2)


@torch.no_grad()
def capture_teacher_qk(
    teacher, input_ids, layers: list[int], attention_mask=None, *, rope: bool = False, logits: bool = False
):
    """Teacher layer → (K, Q) per token for ``layers``, and the teacher's logits if ``logits``
    (otherwise the forward stops after the last layer's attention: no later layer, no LM head)."""
    from attn2ssm.adapters import capture_teacher_attention, get_adapter

    adapter = get_adapter(teacher)
    io, out = capture_teacher_attention(teacher, input_ids, layers, attention_mask, logits=logits)
    captured = {
        j: teacher_qk(adapter, x.module, x.hidden_states, x.position_embeddings, rope) for j, x in io.items()
    }
    return captured, out


def capture_student_bc(student, input_ids, layers: list[int], attention_mask=None, *, logits: bool = False):
    """Student layer → (B, C) per token (with gradients) for ``layers``, read from each mixer's
    ``bc_tap`` (mixers/taps.py) by a forward hook removed afterwards; and the student's logits if
    ``logits`` (otherwise the forward stops after the last of those layers' mixers)."""
    mixers = student.mixers()
    last, captured = max(layers), {}

    def hook_for(i: int):
        def hook(tap, args, output):
            captured[i] = args  # (B, C)

        return hook

    def stop(module, args, output):
        raise _Stop

    handles = [mixers[i].bc_tap.register_forward_hook(hook_for(i)) for i in layers]
    if not logits:
        handles.append(mixers[last].register_forward_hook(stop))
    out = None
    try:
        out = student(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = set(layers) - set(captured)
    if missing:
        raise RuntimeError(f"student mixers of layers {sorted(missing)} did not report B and C")
    return captured, out


# --------------------------------------------------------------------------------------------
# the stage kind


class BridgeAlignmentStage(StageKind):
    """Stage kind ``bridge_alignment`` (CAB, Alg. 2 stage 1): student and teacher each run
    their own forward; each student mixer's B and C are mapped by its bridges onto the K and Q of
    its paired teacher layer (Eq. 8). Typical: ``trainable: [mixers]`` or ``[all]`` (the paper
    updates the whole student; the bridges always train), then a ``kd`` stage.
    """

    name = "bridge_alignment"
    uses_teacher = True
    # The bridges are used outside the student's forward: the trainer runs the stage unwrapped
    # and averages gradients across processes itself, as for layer-local kinds.
    through_model_forward = False
    loss_defaults = {
        "b_weight": 1.0,
        "c_weight": 1.0,
        "kl_weight": 0.0,
        "ce_weight": 0.0,
        "hidden": 0,
        "targets": "pre_rope",
        "bridges": "per_layer",
        "layer_map": "student",
    }
    loss_choices = {"targets": TARGETS, "bridges": SHARING, "layer_map": ("student", *LAYER_MAPS)}

    def options(self, cfg) -> dict:
        opts = super().options(cfg)
        hidden = opts["hidden"]
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 0:
            raise ConfigError(
                f"stage '{cfg.name}' ({self.name}): losses.hidden is {hidden!r}",
                "set losses.hidden to a width such as 256, or 0 for each bridge's output width",
            )
        return opts

    def stage_modules(self, student, teacher, cfg) -> Bridges:
        """The training-only modules of this stage: fresh bridges for the student's mixer layers."""
        opts = self.options(cfg)
        return build_bridges(
            student, teacher, hidden=opts["hidden"], sharing=opts["bridges"], mode=opts["layer_map"]
        )

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        student = getattr(student, "module", student)
        bridges = getattr(student, "stage_modules", None)
        if not isinstance(bridges, Bridges):
            raise ConfigError(
                f"stage '{cfg.name}': the student carries no bridges",
                "run bridge_alignment stages through the distillation trainer (attn2ssm distill)",
            )
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        want_kl, want_logits = bool(opts["kl_weight"]), bool(opts["kl_weight"] or opts["ce_weight"])
        targets, t_logits = capture_teacher_qk(
            teacher,
            ids,
            sorted(set(bridges.pairs.values())),
            mask,
            rope=opts["targets"] == "post_rope",
            logits=want_kl,
        )
        feats, s_logits = capture_student_bc(student, ids, sorted(bridges.pairs), mask, logits=want_logits)
        b_pairs, c_pairs = [], []
        for i, j in sorted(bridges.pairs.items()):
            (B, C), (K, Q) = feats[i], targets[j]
            phi_B, phi_C = bridges.pair(i)
            b_pairs.append((phi_B(B).unflatten(-1, K.shape[-2:]), K))
            c_pairs.append((phi_C(C).unflatten(-1, Q.shape[-2:]), Q))
        loss, b, c = attention_bridge_loss(
            b_pairs, c_pairs, mask, b_weight=opts["b_weight"], c_weight=opts["c_weight"]
        )
        metrics = {"align_B": b.detach(), "align_C": c.detach()}
        if opts["kl_weight"]:
            kl = forward_kl(s_logits, t_logits, mask, temperature=cfg.temperature, chunk_size=cfg.kl_chunk)
            loss = loss + opts["kl_weight"] * kl
            metrics["kl"] = kl.detach()
        if opts["ce_weight"]:
            ce = cross_entropy(s_logits, ids, mask)
            loss = loss + opts["ce_weight"] * ce
            metrics["ce"] = ce.detach()
        return loss, metrics
