"""Decode-mode mixer classes: what makes a student mixer's one-token step fast on a CPU.

The mixers (``attn2ssm.mixers``) are their papers' recurrences, one projection at a time.
``cpu_decode_layout`` mixes one of these classes into each mixer's class (``decode_class``;
``undo_cpu_decode_layout`` takes it out again); they compute the same things in fewer ops:

- every mixer: the layers in its ``input_linears`` become row blocks of one buffer
  (``FusedLinears``), read with ONE matmul (``project_inputs``);
- linear attention: a hand-fused ``step`` — q | k | v in one matmul, q and k roped together with
  a signed sin made once per token for all the model's mixers (``SignedSin``), both softmax-
  Hedgehog maps in one batched matmul over their stacked parameters (``StackedMaps``), and the
  state updated in place (the cache owns it; a rollback snapshot is a clone); with a softmax
  window, the same q, k and features into ``window_linear_attention_step``.

Each steps aside (to the mixer's own code) with autograd on or when a fusion no longer holds. Inside
a compiled decode step's trace (compiled.py) the fusions are used unchecked (the step checked them
before its call), products run as the row blocks the step keeps on the module, and a state comes
back new (no in-place update inside a graph). Tests hold every decode-mode step equal to the
mixer's own (tests/decode/test_mixers.py).
"""

from __future__ import annotations

import torch

from attn2ssm.decode.fusion import (
    FusedLinears,
    ParamStack,
    call_linear,
    decode_class,
    drop_fusions,
    fusion_holds,
    is_plain_linear,
)
from attn2ssm.mixers.feature_maps import HedgehogMap
from attn2ssm.mixers.linear_attention import LinearAttentionMixer
from attn2ssm.ops.linear_attention import linear_attention_step, window_linear_attention_step
from attn2ssm.ops.rope import apply_rotary, apply_rotary_full, signed_sin


class MixerDecode:
    """Mixed into a student mixer's class: its input projections read with one matmul."""

    def _apply(self, fn, recurse=True):  # .to() / .half(): fused buffers would pin the old storage
        drop_fusions(self)
        return super()._apply(fn, recurse)

    def project_inputs(self, x: torch.Tensor) -> dict:
        fused = self.__dict__.get("_fused_inputs")
        if torch.is_grad_enabled() or not fusion_holds(fused):
            return super().project_inputs(x)
        return dict.fromkeys(self.input_linears) | dict(zip(fused.names, fused(x)))


def fuse_inputs(mixer) -> bool:
    """Make ``mixer``'s ``input_linears`` row blocks of one buffer (values unchanged, no extra
    memory); False when fewer than two of them are plain linear layers."""
    names = [n for n in mixer.input_linears if getattr(mixer, n, None) is not None]
    linears = [getattr(mixer, n) for n in names]
    if len(linears) < 2 or not all(is_plain_linear(lin) for lin in linears):
        return False
    # not a submodule: no state-dict entry
    mixer.__dict__["_fused_inputs"] = FusedLinears(mixer, names, linears)
    return True


# -------------------------------------------------------------------------------- linear attention
class StackedMaps:
    """A mixer's query and key Hedgehog maps with their weights and biases stacked (one buffer
    each, ``ParamStack``): a decode step computes both maps' features in one matmul. Used only
    while both maps are still the mixer's, hook-free, and their parameters where they were put."""

    def __init__(self, owner, maps):
        self.owner, self.maps = owner, maps
        self.weight, self.bias = ParamStack([m.weight for m in maps]), ParamStack([m.bias for m in maps])

    def valid(self) -> bool:
        modules = self.owner._modules
        if (
            modules.get("feature_map_q") is not self.maps[0]
            or modules.get("feature_map_k") is not self.maps[1]
        ):
            return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.maps):
            return False
        return self.weight.valid() and self.bias.valid()

    def release(self) -> None:
        self.weight.release()
        self.bias.release()

    def rebuild(self) -> None:
        self.weight.rebuild()
        self.bias.rebuild()


def stack_maps(mixer) -> bool:
    """Stack a linear-attention mixer's query and key maps when both are softmax Hedgehog maps."""
    maps = (mixer.feature_map_q, mixer.feature_map_k)
    if mixer.__dict__.get("_fused_maps") is not None or not all(_softmax_hedgehog(m) for m in maps):
        return False
    mixer.__dict__["_fused_maps"] = StackedMaps(mixer, maps)
    return True


def _softmax_hedgehog(fmap) -> bool:
    return type(fmap) is HedgehogMap and fmap.activation == "softmax"


def hedgehog_softmax_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax-Hedgehog features of one token: x (b, H, d), weight (H, d, p), bias (H, p) →
    (b, H, 2p) float32, as ``HedgehogMap.forward``. H may stack several maps' heads (a mixer's
    query and key maps at once)."""
    b, heads, d = x.shape
    if x.dtype != weight.dtype:  # (skipping no-op casts: a decode step is op-count bound)
        x = x.to(weight.dtype)
    if b == 1:  # views, no transposed (strided) operands: the common decode case
        z = torch.baddbmm(bias.view(heads, 1, -1), x.reshape(heads, 1, d), weight).view(1, heads, -1)
    else:
        # (H, b, p) → (b, H, p)
        z = torch.baddbmm(bias[:, None, :], x.transpose(0, 1), weight).transpose(0, 1)
    if z.dtype != torch.float32:
        z = z.float()
    return torch.softmax(torch.cat([z, -z], dim=-1), dim=-1)


def map_step(fmap, x: torch.Tensor, seen: int | None) -> torch.Tensor:
    """One token's features: x (b, h, d) → (b, h, f) float32, as ``fmap(x[:, :, None], positions)``.
    A hook-free softmax Hedgehog map in a few ops; any other map (or a hooked one) through its call."""
    if _softmax_hedgehog(fmap) and not (fmap._forward_hooks or fmap._forward_pre_hooks):
        return hedgehog_softmax_step(x, fmap.weight, fmap.bias)
    if seen is None and getattr(fmap, "uses_positions", False):
        raise ValueError(f"{type(fmap).__name__} needs the token's position: pass step(..., seen=)")
    positions = None if seen is None else torch.arange(seen, seen + 1, device=x.device)  # position-aware maps
    return fmap(x[:, :, None], positions)[:, :, 0].float()


class SignedSin:
    """``signed_sin(sin)`` made once per token for all of a model's mixers: they get the same sin
    tensor (the rotary module runs once per forward), so the last one is kept with its sin."""

    def __init__(self):
        self.sin = self.signed = None

    def __call__(self, sin: torch.Tensor) -> torch.Tensor:
        if self.sin is not sin:
            self.sin, self.signed = sin, signed_sin(sin)
        return self.signed


class LinearAttentionDecode(MixerDecode):
    """Mixed into ``LinearAttentionMixer``: the hand-fused one-token step of the module docstring."""

    def step(self, hidden_states, position_embeddings, states: dict, mask=None, seen: int | None = None):
        if torch.is_grad_enabled():
            return super().step(hidden_states, position_embeddings, states, mask=mask, seen=seen)
        b = hidden_states.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv_rows(hidden_states).view(b, h + 2 * kv, d)
        qk, v = qkv[:, : h + kv], qkv[:, h + kv :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], 1)
        if self.use_rope and position_embeddings is not None and self.rotary_dim:
            qk = self._rope(qk, *position_embeddings)
        # (b, 2h, d): q heads, then k heads repeated
        rows = self._index("_qk_rows", qk.device)
        heads = qk.index_select(1, rows)
        fq, fk = self._step_features(heads, seen)
        v = v.index_select(1, self._index("_kv_rows", v.device)).float()
        if "linear" not in states:  # a softmax window (the mixer's can_step: full)
            if self.rope == "window" and position_embeddings is not None and self.rotary_dim:
                # the window reads rotated q, k (the maps read them unrotated)
                heads = self._rope(qk, *position_embeddings).index_select(1, rows)
            m = None if mask is None else mask.view(-1)
            q, k = heads[:, :h], heads[:, h:]
            opts = self._window_kwargs()
            y, state = window_linear_attention_step(q, k, v, fq, fk, states["window"], mask=m, **opts)
            return call_linear(self.o_proj, y.to(hidden_states.dtype).view(b, 1, h * d)), {"window": state}
        if mask is not None:  # a padded token adds nothing to the state
            m = mask.to(torch.float32).view(-1, 1, 1)
            fk, v = fk * m, v * m
        # in place in eager steps (no allocation); a traced step returns a new state (no copy-back)
        y, state = linear_attention_step(
            fq,
            fk,
            v,
            states["linear"],
            eps=self.eps,
            inplace=not torch.compiler.is_compiling(),
            log_decay=self.log_decay(),
        )
        if y.dtype != hidden_states.dtype:
            y = y.to(hidden_states.dtype)
        return call_linear(self.o_proj, y.view(b, 1, h * d)), {"linear": state}

    def _qkv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(b, 1, (h + 2·kv)·d): rows q | k | v (``input_linears``' order), one matmul when fused."""
        fused = self.__dict__.get("_fused_inputs")
        if fusion_holds(fused):
            return fused.matmul(x)
        return torch.cat(
            [call_linear(self.q_proj, x), call_linear(self.k_proj, x), call_linear(self.v_proj, x)], -1
        )

    def _rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k heads (b, h + kv, d) rotated together."""
        # partial rotary (Phi, GPT-NeoX): the general form over (b, heads, 1, d)
        if self.rotary_dim != self.head_dim:
            return apply_rotary(qk[:, :, None], cos, sin, self.rotary_dim)[:, :, 0]
        shared = self.__dict__.get("_signed_sin")
        if shared is None or torch.compiler.is_compiling():  # (a compiled step fuses it anyway)
            return apply_rotary_full(qk, cos, sin)
        return apply_rotary_full(qk, cos, sin, shared(sin))

    def _step_features(self, heads: torch.Tensor, seen: int | None):
        """(φq, φk) of the query heads and the repeated key heads, each (b, h, f) float32."""
        h = self.num_heads
        maps = self.__dict__.get("_fused_maps")
        if fusion_holds(maps):
            features = hedgehog_softmax_step(heads, maps.weight.buffer, maps.bias.buffer)
            return features[:, :h], features[:, h:]
        return map_step(self.feature_map_q, heads[:, :h], seen), map_step(
            self.feature_map_k, heads[:, h:], seen
        )

    def _index(self, key: str, device) -> torch.Tensor:
        """Kept per device: ``_qk_rows`` (2h,) rows of the (h + kv) roped q/k heads — every query
        head, then each one's key head; ``_kv_rows`` (h,) the kv head of each query head."""
        cached = self.__dict__.get(key)
        if cached is None or cached.device != torch.device(device):
            kv_of = torch.arange(self.num_heads, device=device) // (self.num_heads // self.num_kv_heads)
            cached = (
                torch.cat([torch.arange(self.num_heads, device=device), self.num_heads + kv_of])
                if key == "_qk_rows"
                else kv_of
            )
            self.__dict__[key] = cached
        return cached


def attach(mixer, signed: SignedSin) -> bool:
    """Put ``mixer`` (a student mixer) in decode mode: its decode-mode class, its fusions, the
    model's ``SignedSin``. True if anything changed."""
    changed = False
    if "_decode_base" not in type(mixer).__dict__:
        mixin = LinearAttentionDecode if isinstance(mixer, LinearAttentionMixer) else MixerDecode
        mixer.__class__ = decode_class(mixin, type(mixer))
        changed = True
    if isinstance(mixer, LinearAttentionMixer):
        mixer.__dict__.setdefault("_signed_sin", signed)
        changed = stack_maps(mixer) or changed
    if mixer.__dict__.get("_fused_inputs") is None:
        changed = fuse_inputs(mixer) or changed
    return changed


def detach(mixer) -> None:
    """What ``attach`` kept on ``mixer`` besides its class and fusions (undo_cpu_decode_layout)."""
    for key in ("_signed_sin", "_qk_rows", "_kv_rows"):
        mixer.__dict__.pop(key, None)
