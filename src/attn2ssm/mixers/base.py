"""What every mixer shares: the teacher's q/k/v/o projections, the HF attention call signature
and access to its own recurrent state in the student cache.

A mixer is called exactly like the attention module it replaces,
``mixer(hidden_states, position_embeddings=..., attention_mask=..., cache=..., ...)``,
and returns ``(output, None)``. The 4-D mask HF builds for softmax attention is of no use to a
recurrent mixer, so the student model publishes the 2-D padding mask of the current tokens in a
``MixerContext`` shared by all its mixers before each forward, and the cache of that forward
with it: what transformers calls the cache argument has changed (``past_key_values`` → ``cache``
in 5.24, see hf_compat.py), the context has not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from attn2ssm.hf_compat import explicit_cache
from attn2ssm.ops.kernels import default_kernels
from attn2ssm.ops.rope import apply_rotary


@dataclass
class MixerContext:
    """Per-forward facts the student model hands to its mixers."""

    padding_mask: torch.Tensor | None = None  # (b, l) 1 = real token, for the tokens of this forward
    cache: object | None = None  # the student cache of this forward (None: no cache)
    # what the chunked forms run: auto | torch | fla (ops/kernels.py); a run sets it once (and builds
    # its students inside building_with), and ATTN2SSM_KERNELS, where set, is the default of a model
    # loaded outside a run
    kernels: str = field(default_factory=default_kernels)


class HeadRMSNorm(nn.Module):
    """Per-head RMSNorm over head_dim; ``offset=1`` stores the weight as w with scale (1 + w) (Gemma)."""

    def __init__(self, head_dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(head_dim) if offset else torch.ones(head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


def _record_inputs(mixer, args, kwargs):
    """Hand this call's inputs to the cache layer (it keeps them only while recording past states)."""
    layer = mixer.cache_layer(kwargs)
    if layer is not None and getattr(layer, "record_past", False):
        hidden = args[0] if args else kwargs["hidden_states"]
        layer.record(mixer, hidden, kwargs.get("position_embeddings"), mixer.padding_mask(hidden.shape[1]))


class AttentionLikeMixer(nn.Module):
    """Base class: holds q/k/v/o in the teacher's geometry and parses the HF call."""

    # Linear layers that read the mixer's input (``project_inputs``)
    input_linears: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")

    def __init__(self, geometry: dict, layer_idx: int):
        super().__init__()
        g = geometry
        self.layer_idx = layer_idx
        self.hidden_size = g["hidden_size"]
        self.num_heads, self.num_kv_heads, self.head_dim = g["num_heads"], g["num_kv_heads"], g["head_dim"]
        self.rotary_dim = g.get("rotary_dim", 0)
        qkv_bias, o_bias = g.get("qkv_bias", False), g.get("o_bias", False)
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=o_bias)
        if g.get("has_qk_norm", False):
            eps, offset = g.get("qk_norm_eps", 1e-6), g.get("qk_norm_offset", 0.0)
            self.q_norm = HeadRMSNorm(self.head_dim, eps, offset)
            self.k_norm = HeadRMSNorm(self.head_dim, eps, offset)
        else:
            self.q_norm = self.k_norm = None
        # Not a submodule: set by the student model (shared by all its mixers).
        self.context = MixerContext()
        # A cache that may be rolled back (speculative decoding) keeps what this mixer reads.
        self.register_forward_pre_hook(_record_inputs, with_kwargs=True)

    # -- teacher weights -------------------------------------------------------------------
    @torch.no_grad()
    def load_attention_weights(self, w) -> None:
        """Copy an ``AttentionWeights`` (canonical layout) into q/k/v/o (and q/k norms)."""
        for proj, weight, bias in (
            (self.q_proj, w.q, w.q_bias),
            (self.k_proj, w.k, w.k_bias),
            (self.v_proj, w.v, w.v_bias),
            (self.o_proj, w.o, w.o_bias),
        ):
            proj.weight.copy_(weight)
            if proj.bias is not None and bias is not None:
                proj.bias.copy_(bias)
        for mine, theirs in ((self.q_norm, w.q_norm), (self.k_norm, w.k_norm)):
            if mine is not None and theirs is not None:
                mine.weight.copy_(theirs.weight)

    # -- shared projections ------------------------------------------------------------------
    def project_inputs(self, x: torch.Tensor) -> dict:
        """name → output of every ``input_linears`` layer on x (None for an absent one). Each
        layer reads x by itself here; CPU decode mode (``attn2ssm.decode``) reads them with one
        matmul instead."""
        out = {}
        for name in self.input_linears:
            linear = getattr(self, name, None)
            out[name] = None if linear is None else linear(x)
        return out

    def project_heads(self, x: torch.Tensor, position_embeddings=None, inputs: dict | None = None):
        """x (b, l, hidden) → q (b, l, h, d), k and v (b, l, kv, d): q/k norms and RoPE applied
        (RoPE only when ``position_embeddings`` is given), kv heads NOT repeated. ``inputs``:
        this x's ``project_inputs``, when the caller already has them."""
        b, l, _ = x.shape
        if inputs is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = inputs["q_proj"], inputs["k_proj"], inputs["v_proj"]
        q = q.view(b, l, self.num_heads, self.head_dim)
        k = k.view(b, l, self.num_kv_heads, self.head_dim)
        v = v.view(b, l, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if position_embeddings is not None and self.rotary_dim:
            cos, sin = position_embeddings  # (b, l, rotary) — rotate with heads as dim 2
            q = apply_rotary(q.transpose(1, 2), cos, sin, self.rotary_dim).transpose(1, 2)
            k = apply_rotary(k.transpose(1, 2), cos, sin, self.rotary_dim).transpose(1, 2)
        return q, k, v

    def repeat_kv(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Repeat kv heads over their query group along ``dim`` (GQA: query head j reads kv head j // groups)."""
        if self.num_heads == self.num_kv_heads:
            return t
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=dim)

    def project_qkv(self, x: torch.Tensor, position_embeddings=None, inputs: dict | None = None):
        """x (b, l, hidden) → q (b, h, l, d), k and v (b, h, l, d) with kv heads repeated (GQA)."""
        q, k, v = self.project_heads(x, position_embeddings, inputs)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return q, self.repeat_kv(k, 1), self.repeat_kv(v, 1)

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """(b, h, l, d) → o_proj((b, l, h·d))."""
        b, h, l, d = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, l, h * d))

    # -- one token against the carried states -------------------------------------------------
    # A mixer with a recurrent step defines
    #     step(u, position_embeddings, states, mask=None, seen=None) -> (y, new states)
    # u (b, 1, hidden) → y (b, 1, hidden) and {state name: new state}: its recurrence for one token,
    # as its paper writes it. It is the mixer's ONE one-token path: its forward runs it for every
    # one-token call with states (padded or not), and so do a cache rollback's replay and the decode
    # plan. ``mask`` (b, 1): 1 where the row's token is real; a padded row's recurrent state is left
    # as it was (its conv window takes a zero, as in the chunked form, ops/conv.py) and its output is
    # whatever is cheapest. ``seen``: tokens before this one (read only by position-aware feature
    # maps). The states passed in are left as they were.
    def can_step(self, layer) -> bool:
        """Can ``step`` take one token with this cache layer's states? (False: no step.)"""
        return False

    def step_layer(self, hidden_states, position_embeddings, layer, mask=None):
        """``step`` against ``layer``'s states, then the new states stored and the token counted."""
        y, states = self.step(hidden_states, position_embeddings, layer.states, mask=mask, seen=layer.seen)
        layer.states.update(states)
        layer.advance(1)
        return y

    # -- HF call plumbing ----------------------------------------------------------------------
    def forward(self, hidden_states, *args, position_embeddings=None, **kwargs):
        """HF's attention call: one token with a cache layer ``step`` can take → ``step``; else ``mix``
        over the whole sequence (chunked, with the cache's states carried in and stored). Returns
        (y, None): no attention weights."""
        layer = self.cache_layer(kwargs)
        if hidden_states.shape[1] == 1 and layer is not None and self.can_step(layer):
            return self.step_layer(hidden_states, position_embeddings, layer, self.padding_mask(1)), None
        return self.mix(hidden_states, position_embeddings, layer), None

    def mix(self, hidden_states, position_embeddings, layer):
        """(b, l, hidden) → (b, l, hidden) over the sequence, ``layer``: this layer's cache states or None."""
        raise NotImplementedError

    def cache_layer(self, kwargs: dict):
        """This layer's ``MixerStateLayer`` in the student cache, or None when running without one.
        A cache passed to this call (under any name transformers has used) wins over the one the
        student published in the context for this forward."""
        cache = explicit_cache(kwargs)
        if cache is None:
            cache = self.context.cache
        if cache is None:
            return None
        if not hasattr(cache, "mixer_layer"):
            raise TypeError(
                f"layer {self.layer_idx}'s {type(self).__name__} got a {type(cache).__name__}, which has no recurrent state: "
                "pass the student's own cache (model.new_cache())"
            )
        return cache.mixer_layer(self.layer_idx)

    def padding_mask(self, length: int) -> torch.Tensor | None:
        m = self.context.padding_mask
        return None if m is None else m[:, -length:]
