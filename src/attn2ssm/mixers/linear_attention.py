"""Causal linear attention as a drop-in for a teacher attention module.

Starts from the teacher's q/k/v/o (GQA kv heads repeated), applies RoPE where the teacher does
(before the feature map by default, so student and teacher see the same q and k), then
φ(q), φ(k) and normalised linear attention. Training and prefill use the chunked form, one-token
decode the step form; both carry the same ``LinearAttentionState`` in the student cache. With
``decay: true`` the linear weights decay per head, λ_h^(i−j) learned (gated linear attention with a
scalar gate; ops/linear_attention.py), in prefill and decode alike — fla's kernel has no decay, so a
decayed prefill runs the PyTorch chunked form on every device.
"""

from __future__ import annotations

import math

import torch

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.base import AttentionLikeMixer
from attn2ssm.mixers.feature_maps import build_feature_map
from attn2ssm.mixers.options import NonNegativeInt, PositiveFloat, PositiveInt
from attn2ssm.ops.linear_attention import (
    linear_attention_chunked,
    linear_attention_quadratic,
    linear_attention_step,
    window_linear_attention,
    window_linear_attention_chunked,
    window_linear_attention_step,
)
from attn2ssm.ops.rope import apply_rotary

ROPE_MODES = ("before_map", "window", "none")


class LinearAttentionMixer(AttentionLikeMixer):
    mixer_type = "linear_attention"
    # forward_quadratic's matrix is normalised attention (rows sum to 1): attention transfer can
    # match it to the teacher's softmax weights
    normalized_weights = True

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        feature_map: str = "elu",
        feature_map_options: dict | None = None,
        chunk_size: PositiveInt = 64,
        eps: PositiveFloat = 1e-6,
        rope: str = "before_map",
        window: NonNegativeInt = 0,
        window_gamma: float = 0.5,
        window_dropout: float = 0.0,
        decay: bool = False,
        decay_horizon: PositiveFloat = 4096.0,
        window_train_min: NonNegativeInt = 0,
    ):
        super().__init__(geometry, layer_idx)
        opts = feature_map_options or {}
        self.feature_map_q = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.feature_map_k = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.chunk_size, self.eps = chunk_size, eps
        if rope not in ROPE_MODES:
            raise ConfigError(
                f"linear_attention option rope={rope!r} is not valid",
                "use rope: before_map (default), window or none",
            )
        # before_map: the feature maps read rotated q/k (LoLCATs); none: no RoPE anywhere; window: the
        # softmax window reads rotated q/k, the feature maps the unrotated ones, so the linear branch's
        # weights depend on content (and the decay) only, never on absolute positions past training.
        self.use_rope, self.rope = rope == "before_map", rope
        self._init_window(geometry, window, window_gamma, window_dropout, window_train_min)
        if rope == "window" and not window:
            raise ConfigError(
                "linear_attention option rope=window needs a softmax window (window > 0)",
                "set window (e.g. 64), or use rope: none for linear attention alone",
            )
        # Gated linear attention with a scalar gate per head: key j's linear weight for query i is
        # λ_h^(i−j)·φq_i·φk_j, λ_h = exp(−exp(decay_log_rate_h)) learned, starting at exp(−1/decay_horizon)
        # (a horizon past the training blocks barely changes the function at init).
        self.decay = bool(decay)
        if self.decay:
            self.decay_log_rate = torch.nn.Parameter(torch.full((self.num_heads,), -math.log(decay_horizon)))
        # Which branch runs (an evaluation-time ablation, not saved): both | window (the softmax window
        # alone) | linear (every key through the feature maps: linear attention without the window).
        self.branch = "both"

    def _init_window(
        self, geometry: dict, window: int, window_gamma: float, window_dropout: float, window_train_min: int
    ) -> None:
        """The softmax window's options and its learned per-head γ (none without a window)."""
        # LoLCATs-style: the last `window` keys get exact softmax weights γ_h·exp(q·k·scale − max),
        # older keys linear weights; γ_h = sigmoid(window_factor_h) is learned per head.
        if window < 0 or not 0.0 < window_gamma < 1.0:
            raise ConfigError(
                f"window={window}, window_gamma={window_gamma} are out of range",
                "use window >= 0 and 0 < window_gamma < 1",
            )
        self.window, self.scaling = window, geometry.get("scaling", self.head_dim**-0.5)
        if window:
            # γ = sigmoid(factor) starts at window_gamma. Plain floats: __init__ runs on the meta
            # device when transformers loads a model, where a tensor has no value to read back.
            self.window_factor = torch.nn.Parameter(
                torch.full((self.num_heads,), math.log(window_gamma / (1.0 - window_gamma)))
            )
        # Scheduled sliding-window dropout ("Paying Attention to Hybrid Attention"): a window + linear
        # student learns to bypass its linear branch; with probability window_dropout a training
        # forward runs the linear branch alone, so it has to carry the sequence.
        if (
            isinstance(window_dropout, bool)
            or not isinstance(window_dropout, (int, float))
            or not 0.0 <= window_dropout < 1.0
        ):
            raise ConfigError(
                f"linear_attention option window_dropout={window_dropout!r} is not in [0, 1)",
                "use e.g. window_dropout: 0.25, or 0",
            )
        self.window_dropout = float(window_dropout)
        # Random windows in training (SWAX: "Short window attention enables long-term memorization"):
        # each training forward draws its window uniformly from [window_train_min, window], so the
        # linear branch has to carry what a short window drops; evaluation and decode use `window`.
        if window_train_min and not 1 <= window_train_min <= window:
            raise ConfigError(
                f"linear_attention option window_train_min={window_train_min} is not in [1, window={window}]",
                "use 0 (off) or a window_train_min between 1 and the window (and a window > 0)",
            )
        self.window_train_min = window_train_min

    def _qkv_features(self, hidden_states, position_embeddings=None, offset: int = 0):
        inputs = self.project_inputs(hidden_states)
        q, k, v = self.project_qkv(hidden_states, position_embeddings if self.use_rope else None, inputs)
        positions = torch.arange(offset, offset + hidden_states.shape[1], device=hidden_states.device)
        fq, fk = self.feature_map_q(q, positions), self.feature_map_k(k, positions)
        if self.rope == "window" and position_embeddings is not None and self.rotary_dim:
            cos, sin = position_embeddings
            q, k = (apply_rotary(t, cos, sin, self.rotary_dim) for t in (q, k))
        return q, k, v, fq, fk

    def features(self, hidden_states, position_embeddings=None, offset: int = 0):
        """(φq, φk, v), each (b, h, l, ·) — exposed for distillation losses. ``offset`` is the
        absolute position of the first token (tokens already in the state), for position-aware maps."""
        _, _, v, fq, fk = self._qkv_features(hidden_states, position_embeddings, offset)
        return fq, fk, v

    def log_decay(self) -> torch.Tensor | None:
        """(h,) log λ_h = −exp(decay_log_rate_h) < 0, or None without a decay."""
        return -torch.exp(self.decay_log_rate.float()) if self.decay else None

    def _window_kwargs(self) -> dict:
        window = self.window
        if self.training and self.window_train_min:  # SWAX-style: this training forward's own window
            window = int(torch.randint(self.window_train_min, self.window + 1, ()))
        return {
            "scaling": self.scaling,
            "window": window,
            "gamma": torch.sigmoid(self.window_factor),
            "eps": self.eps,
            "log_decay": self.log_decay(),
        }

    def attention_weights(self, hidden_states, position_embeddings=None, mask=None):
        """The materialised (b, h, l, l) mixing matrix for this input (quadratic form)."""
        return self.forward_quadratic(hidden_states, position_embeddings, mask)[1]

    def forward_quadratic(self, hidden_states, position_embeddings=None, mask=None):
        """(output (b, l, hidden), weights (b, h, l, l)) through the materialised form — for
        attention transfer, which needs both and runs on short blocks."""
        if self.window:
            q, k, v, fq, fk = self._qkv_features(hidden_states, position_embeddings)
            y, _, weights = window_linear_attention(
                q, k, v, fq, fk, mask=mask, return_weights=True, **self._window_kwargs()
            )
            return self.merge_heads(y), weights
        fq, fk, v = self.features(hidden_states, position_embeddings)
        y, weights = linear_attention_quadratic(fq, fk, v, mask, eps=self.eps, log_decay=self.log_decay())
        return self.merge_heads(y), weights

    def step(self, hidden_states, position_embeddings, states: dict, mask=None, seen: int | None = None):
        """One token against the carried state (see ``AttentionLikeMixer``):
            S_t = λ S_{t−1} + φ(k_t) v_tᵀ,   z_t = λ z_{t−1} + φ(k_t),   y_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps)
        (λ = 1 without a decay)
        → (output, {"linear": new state}). ``seen`` is read only by a position-aware feature map.
        With a softmax window (branch "both", the window full: ``window − 1`` tokens cached) the
        token reads the window exactly and the older tokens through the sums
        (``window_linear_attention_step``) → (output, {"window": new state})."""
        maps = (self.feature_map_q, self.feature_map_k)
        if seen is None and any(getattr(m, "uses_positions", False) for m in maps):
            raise ValueError(
                f"{type(self.feature_map_q).__name__} needs the token's position: pass step(..., seen=)"
            )
        q, k, v, fq, fk = self._qkv_features(
            hidden_states, position_embeddings, offset=0 if seen is None else seen
        )
        q, k, fq, fk, v = q[:, :, 0], k[:, :, 0], fq[:, :, 0], fk[:, :, 0], v[:, :, 0]  # (b, h, ·)
        if self.window and self.branch != "linear":
            if self.branch == "window":  # as in ``mix``: the window's softmax alone
                fk = torch.zeros_like(fk)
            opts = self._window_kwargs()
            m = None if mask is None else mask.view(-1)
            y, state = window_linear_attention_step(q, k, v, fq, fk, states["window"], mask=m, **opts)
            return self.merge_heads(y[:, :, None]), {"window": state}
        if mask is not None:  # a padded token adds nothing to the state
            m = mask.view(-1, 1, 1)
            fk, v = fk * m.to(fk.dtype), v * m.to(v.dtype)
        y, state = linear_attention_step(
            fq, fk, v, states["linear"], eps=self.eps, log_decay=self.log_decay()
        )
        return self.merge_heads(y[:, :, None]), {"linear": state}

    def can_step(self, layer) -> bool:
        if not self.window or self.branch == "linear":
            return "linear" in layer.states
        state = layer.states.get("window")  # the window step needs it full (a prompt ≥ window − 1)
        return self.branch == "both" and state is not None and state.keys.shape[2] == max(self.window - 1, 0)

    def _branch(self) -> str:
        """The branch this forward runs: ``branch``, or the linear one alone for a window-dropout draw."""
        if (
            self.window
            and self.training
            and self.window_dropout
            and float(torch.rand(())) < self.window_dropout
        ):
            return "linear"
        return self.branch if self.window else "both"

    def mix(self, hidden_states, position_embeddings, layer):
        b, l, _ = hidden_states.shape
        q, k, v, fq, fk = self._qkv_features(
            hidden_states, position_embeddings, offset=0 if layer is None else layer.seen
        )
        mask = self.padding_mask(l)
        branch = self._branch()
        if branch == "window":  # features zeroed: the window's softmax alone (renormalised within it)
            fk = torch.zeros_like(fk)
        if self.window and branch != "linear":
            return self._window_forward(q, k, v, fq, fk, mask, layer)
        state = None if layer is None else layer.states.get("linear")
        y, state = linear_attention_chunked(
            fq,
            fk,
            v,
            mask,
            state,
            chunk_size=self.chunk_size,
            eps=self.eps,
            backend=self.context.kernels,
            log_decay=self.log_decay(),
        )
        if layer is not None:
            layer.states["linear"] = state
            layer.advance(l)
        return self.merge_heads(y)

    def _window_forward(self, q, k, v, fq, fk, mask, layer):
        """LoLCATs' window + linear over a prefill. fla has no kernel for it (the window's row max is
        part of the model): on CUDA the loop-free form (a few large kernels), on a CPU blocks of
        chunk_size queries against [window cache; block], which runs faster there (the loop-free
        form materialises every chunk's state: 0.9x at 2k tokens, 0.55x at 16k, fwd+bwd, 1 thread)."""
        state = None if layer is None else layer.states.get("window")
        opts = self._window_kwargs()
        if q.is_cuda and state is None:
            y, state = window_linear_attention_chunked(
                q, k, v, fq, fk, mask=mask, chunk_size=self.chunk_size, return_state=layer is not None, **opts
            )
        else:
            outs = []
            pieces = [
                t.split(self.chunk_size, dim=2) for t in (q, k, v, fq, fk)
            ]  # split: linear-time backward
            masks = [None] * len(pieces[0]) if mask is None else mask.split(self.chunk_size, dim=1)
            for qc, kc, vc, fqc, fkc, mc in zip(*pieces, masks):
                o, state = window_linear_attention(qc, kc, vc, fqc, fkc, mask=mc, state=state, **opts)
                outs.append(o)
            y = torch.cat(outs, 2)
        if layer is not None:
            layer.states["window"] = state
            layer.advance(q.shape[2])
        return self.merge_heads(y)


BRANCHES = ("both", "window", "linear")


def set_window_branch(model, branch: str, name: str = "the model") -> int:
    """Switch every window + linear mixer of ``model`` (LoLCATs' students) to ``branch`` — ``both``
    (as trained), ``window`` (the sliding-window softmax alone) or ``linear`` (linear attention
    without the window) — for evaluation; returns how many mixers it switched. A ConfigError (one
    line) for an unknown branch, or for ``window`` / ``linear`` on a model without such a mixer."""
    if branch not in BRANCHES:
        raise ConfigError(f"--branch {branch!r} is not a branch", f"use one of: {', '.join(BRANCHES)}")
    mixers = [m for m in model.modules() if isinstance(m, LinearAttentionMixer) and m.window]
    if not mixers and branch != "both":
        raise ConfigError(
            f"{name} has no mixer with a softmax window, so it has no {branch} branch to evaluate alone",
            "--branch window|linear applies to LoLCATs-style students (linear_attention with window > 0)",
        )
    for m in mixers:
        m.branch = branch
    return len(mixers)
