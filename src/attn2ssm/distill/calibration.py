"""A calibrated start for the gated delta rule: each head's decay and write strength from what its
teacher attention head does on calibration blocks (``decay_init: calibrated``, the default of the
``gated_delta`` mixer).

Initialisation from the teacher's statistics matters for retrieval, not only perplexity
(Taylor-Calibrate: RULER@4k 0.40 → 0.60 at equal tokens over a zero-gate start). What is
measured, per layer and head, on the teacher's own inputs to the layer (teacher forcing):

* **locality** — the attention-weighted distance d_h = E_i Σ_j P_ij (i − j) over the second half of
  each block (queries that could look far back). A constant decay α keeps a key's weight at α^Δ Δ
  tokens later: the geometric memory α / (1 − α) equals d_h at α_h = d_h / (1 + d_h). A head that
  attends locally forgets fast; one that reads far keeps its state;
* **key crowding** — the mean |cos| between a head's (L2-normalised) keys at different positions.
  The delta rule writes v under k by moving the value stored along k; when keys crowd together
  each write disturbs the others, so the write strength starts lower: β_h = 1 − crowding.

Both are clipped (α to [0.5, 0.9999], β to [0.05, 0.95]) and written with
``GatedDeltaMixer.set_head_decays``; the projections W_a, W_b stay zero, so training starts from
these per-head constants and learns the data-dependent part. A mixer without b_proj's bias
(``beta_bias: false``, the form that exports to Qwen3.5 exactly) has no place for a per-head β: it
gets the decays only, keeps β = 1/2, and its report says ``beta_set: false``.

``calibrate_kept_attention`` does the same for a hybrid's kept attention layers in Qwen3.5's form
(``student.kept_attention: qwen35``): their q/k norm weights from the teacher's q and k on the same
blocks (student/kept_attention.py says which scale and why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn2ssm.adapters import get_adapter
from attn2ssm.adapters.capture import capture_attention_io
from attn2ssm.mixers.gated_delta import GatedDeltaMixer

ALPHA_RANGE = (0.5, 0.9999)
BETA_RANGE = (0.05, 0.95)


@torch.no_grad()
def head_statistics(probs: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention-weighted distance (h,), key crowding (h,)) from probabilities (b, h, l, l) and keys
    (b, l, h, d) of one layer."""
    b, h, l, _ = probs.shape
    pos = torch.arange(l, dtype=torch.float32, device=probs.device)
    distance = (probs.float() * (pos[:, None] - pos[None, :]).clamp_min(0)).sum(-1)  # (b, h, l)
    far = distance[:, :, l // 2 :].mean((0, 2))
    k = F.normalize(keys.float(), dim=-1).transpose(1, 2)  # (b, h, l, d)
    cos = (k @ k.transpose(-1, -2)).abs()  # (b, h, l, l)
    off = ~torch.eye(l, dtype=torch.bool, device=cos.device)
    crowding = cos[..., off].mean((0, 2)) if l > 1 else torch.zeros(h, device=cos.device)
    return far, crowding


def decays_from(distance: torch.Tensor, crowding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(α (h,), β (h,)) from the statistics (see the module docstring)."""
    alpha = (distance / (1.0 + distance)).clamp(*ALPHA_RANGE)
    beta = (1.0 - crowding).clamp(*BETA_RANGE)
    return alpha, beta


@torch.no_grad()
def calibrate_gated_delta(student, teacher, ids: torch.Tensor, layers=None) -> dict[int, dict]:
    """Set every ``gated_delta`` mixer with ``decay_init: calibrated`` (of ``layers`` only, when given:
    the ones a stepwise hybrid just converted, never a trained one) from its teacher layer's
    statistics on ``ids`` (b, l). Returns {layer: {"distance", "crowding", "alpha", "beta"}} (lists)."""
    mixers = {
        i: m
        for i, m in student.mixers().items()
        if isinstance(m, GatedDeltaMixer) and m.decay_init == "calibrated" and (layers is None or i in layers)
    }
    if not mixers:
        return {}
    io = capture_attention_io(teacher, ids, sorted(mixers))
    adapter = get_adapter(teacher)
    report = {}
    for i, mixer in mixers.items():
        x = io[i]
        probs = adapter.attention_probs(x.module, x.hidden_states, x.position_embeddings)
        # (b, l, kv, d): the teacher's keys
        _, keys, _ = mixer.project_heads(x.hidden_states.to(mixer.k_proj.weight.dtype))
        keys = mixer.repeat_kv(keys, 2)  # per query head, as the mixer reads them
        distance, crowding = head_statistics(probs, keys)
        alpha, beta = decays_from(distance, crowding)
        mixer.set_head_decays(alpha, beta)
        report[i] = {
            "distance": distance.tolist(),
            "crowding": crowding.tolist(),
            "alpha": alpha.tolist(),
            "beta": beta.tolist(),
            "beta_set": mixer.b_proj.bias is not None,
        }
    return report


@torch.no_grad()
def calibrate_kept_attention(student, teacher, ids: torch.Tensor) -> dict[int, dict]:
    """Set the q/k norm weights of every kept attention layer in Qwen3.5's form
    (``student.kept_attention: qwen35``, student/kept_attention.py) from its teacher layer's q and k
    on ``ids`` (b, l): the least-squares scale that maps the normalised q (k) back to the teacher's.
    Returns {layer: {"q_norm", "k_norm"}} (the weights' mean, for the log)."""
    layers = {i: m for i, m in student.kept_attention_layers().items() if hasattr(m, "set_norm_weights")}
    if not layers:
        return {}
    source = student.config.teacher_layers or list(range(len(student.config.layer_plan)))
    io = capture_attention_io(teacher, ids, sorted({source[i] for i in layers}))
    report = {}
    for i, module in layers.items():
        hidden = io[source[i]].hidden_states.to(module.q_proj.weight.dtype)
        module.set_norm_weights(*module.heads(hidden))
        report[i] = {
            "q_norm": module.q_norm.weight.float().mean().item(),
            "k_norm": module.k_norm.weight.float().mean().item(),
        }
    return report
