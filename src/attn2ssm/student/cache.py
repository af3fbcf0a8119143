"""The student's cache: KV for kept attention layers, recurrent state for mixer layers.

It is a transformers ``Cache`` whose layers are ``DynamicLayer`` / ``DynamicSlidingWindowLayer``
where attention is kept and ``MixerStateLayer`` where a mixer sits. A mixer layer stores
whatever tensors its mixer needs (``states`` dict) and counts the tokens it has consumed, so
``get_seq_length`` and mask sizes stay right even for a student with no attention at all.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer


def _map_state(value, fn):
    """Apply ``fn`` to every tensor inside a state (tensor, dataclass of tensors, or tuple)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _map_state(getattr(value, f.name), fn) for f in dataclasses.fields(value)})
    if isinstance(value, (tuple, list)):
        return type(value)(_map_state(v, fn) for v in value)
    return value


class MixerStateLayer(CacheLayerMixin):
    """Recurrent state of one mixer layer: O(1) in the sequence length."""

    is_sliding = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self.states: dict = {}
        self.seen = 0
        self.is_initialized = True

    def advance(self, n: int) -> None:
        self.seen += n

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - protocol
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("a mixer layer keeps a recurrent state, not keys and values")

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.states, self.seen = {}, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.states = {k: _map_state(v, lambda t: t.index_select(0, beam_idx.to(t.device))) for k, v in self.states.items()}

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.states = {k: _map_state(v, lambda t: t.repeat_interleave(repeats, dim=0)) for k, v in self.states.items()}

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.states = {k: _map_state(v, lambda t: t[indices]) for k, v in self.states.items()}

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise RuntimeError("a recurrent state cannot be cropped; snapshot it before a speculative step instead")

    def state_bytes(self) -> int:
        """Bytes held by this layer's state (constant in the sequence length)."""
        tensors: list[torch.Tensor] = []
        for v in self.states.values():
            _map_state(v, lambda t: tensors.append(t) or t)
        return sum(t.numel() * t.element_size() for t in tensors)


class Attn2SSMCache(Cache):
    """Hybrid cache built from a student config's layer plan."""

    def __init__(self, config):
        layers = []
        for kind, geom in zip(config.layer_plan, config.layer_geometry):
            if kind != "attention":
                layers.append(MixerStateLayer())
            elif geom.get("sliding_window"):
                layers.append(DynamicSlidingWindowLayer(sliding_window=geom["sliding_window"]))
            else:
                layers.append(DynamicLayer())
        super().__init__(layers=layers)

    def mixer_layer(self, layer_idx: int) -> MixerStateLayer:
        return self.layers[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)
