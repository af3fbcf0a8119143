"""How much memory a model's cache holds at N tokens: the KV cache from the model's structure, the
mixers' constant state from a short probe, and a student's KV cache as a fraction of its teacher's.

The KV cache is what grows with the context. Per layer, at ``tokens`` tokens and ``b`` bytes per
element (the model's parameter dtype):

- a softmax attention layer holds 2 × num_kv_heads × head_dim × N × b (keys and values), a
  sliding-window one 2 × num_kv_heads × head_dim × min(window, N) × b;
- a mixer holds no KV, except in the KV groups it keeps as full softmax attention: a mixer module may
  say how many with an integer attribute ``kv_heads_kept`` (0 where absent), counted as
  2 × kv_heads_kept × head_dim × N × b (a head-level hybrid keeps a few groups, not whole layers).

A mixer's recurrent state (linear attention's S and z, an SSM's state and conv rows, LoLCATs' 64-token
window) does not grow with N: it is reported apart as ``state_bytes``, measured once by
:func:`state_bytes` on a probe of a few tokens. ``attn2ssm eval --suite`` writes
:func:`kv_fraction` of the student against its teacher into suite.json (docs/evaluation.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

KV_TOKENS = 8192  # the built-in teacher's longest context: where the suite reports the KV fraction


@dataclass(frozen=True)
class LayerCache:
    """What one layer keeps per token: ``kind`` attention | mixer, the KV groups with a full (or
    ``window``-token) softmax cache and their head size."""

    kind: str
    kv_heads: int
    head_dim: int
    window: int | None = None  # a sliding-window attention layer's window (tokens); None = global

    def kv_bytes(self, tokens: int, element_bytes: int) -> int:
        held = tokens if self.window is None else min(self.window, tokens)
        return 2 * self.kv_heads * self.head_dim * held * element_bytes


def layer_caches(model) -> list[LayerCache]:
    """Per layer of ``model`` (an attn2ssm student or a transformers model of a supported family),
    what its cache keeps, read from its config and modules without running it."""
    config = model.config
    plan = getattr(config, "layer_plan", None)
    if getattr(config, "model_type", None) == "attn2ssm" and plan:
        mixers = model.mixers()
        out = []
        for i, (kind, geom) in enumerate(zip(plan, config.layer_geometry)):
            if kind == "attention":
                out.append(
                    LayerCache(
                        "attention", geom["num_kv_heads"], geom["head_dim"], geom.get("sliding_window")
                    )
                )
            else:
                kept = int(getattr(mixers[i], "kv_heads_kept", 0) or 0)
                out.append(LayerCache("mixer", kept, geom["head_dim"]))
        return out
    from attn2ssm.adapters import get_adapter

    adapter = get_adapter(config)
    out = []
    for i in range(config.num_hidden_layers):
        g = adapter.geometry(config, i)
        out.append(LayerCache("attention", g.num_kv_heads, g.head_dim, g.sliding_window))
    return out


def kept_kv_groups(model) -> dict[int, list[int]]:
    """Layer → the KV groups its mixer keeps as exact softmax attention (a head-level hybrid's
    ``kept_groups``); empty for every other model."""
    if getattr(model.config, "model_type", None) != "attn2ssm":
        return {}
    return {i: list(m.kept_groups) for i, m in model.mixers().items() if getattr(m, "kept_groups", None)}


def element_bytes(model) -> int:
    """Bytes per cached element: the model's parameter dtype (its keys and values are computed in it)."""
    return next(model.parameters()).element_size()


def kv_bytes(model, tokens: int = KV_TOKENS, element_size: int | None = None) -> int:
    """Bytes of ``model``'s KV cache for one sequence of ``tokens`` tokens (see the module docstring)."""
    size = element_size or element_bytes(model)
    return sum(layer.kv_bytes(tokens, size) for layer in layer_caches(model))


@torch.no_grad()
def state_bytes(model, probe: int | None = None) -> int:
    """Bytes of ``model``'s recurrent mixer state for one sequence: constant in the length, so measured
    on a short probe (0 for a model without mixers). Two probes of P and 2P tokens (P past every
    mixer's window) give the state's constant part exactly where a mixer's cache also holds a part
    that grows with the tokens (the KV of its kept groups, counted by :func:`kv_bytes`):
    2 · s(P) − s(2P)."""
    if not hasattr(model, "new_cache") or not getattr(model.config, "mixer_layers", None):
        return 0
    if probe is None:
        windows = [int(getattr(m, "window", 0) or 0) for m in model.mixers().values()]
        probe = max(windows, default=0) + 2
    sizes = []
    for length in (probe, 2 * probe):
        cache = model.new_cache()
        ids = torch.zeros(1, length, dtype=torch.long, device=next(model.parameters()).device)
        was_training = model.training
        model.eval()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        model.train(was_training)
        sizes.append(sum(layer.state_bytes() for layer in cache.layers if hasattr(layer, "state_bytes")))
    return max(0, 2 * sizes[0] - sizes[1])


@dataclass(frozen=True)
class CacheMemory:
    """A student's cache beside its teacher's at ``tokens`` tokens (one sequence, bytes)."""

    tokens: int
    student_kv_bytes: int
    teacher_kv_bytes: int
    student_state_bytes: int
    kv_fraction: float  # student KV / teacher KV

    def as_dict(self) -> dict:
        return asdict(self)


def kv_fraction(student, teacher, tokens: int = KV_TOKENS) -> CacheMemory:
    """The student's KV-cache bytes at ``tokens`` against the teacher's (both at the teacher's
    element size, so the fraction does not depend on how either was loaded), and the student's state
    (as its cache holds it: some mixers keep their state in fp32 whatever the weights)."""
    size = element_bytes(teacher)
    s, t = kv_bytes(student, tokens, size), kv_bytes(teacher, tokens, size)
    return CacheMemory(tokens, s, t, state_bytes(student), s / t if t else 0.0)
