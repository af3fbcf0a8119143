"""The student's cache: KV for kept attention layers, recurrent state for mixer layers.

It is a transformers ``Cache`` whose layers are ``DynamicLayer`` / ``DynamicSlidingWindowLayer``
where attention is kept and ``MixerStateLayer`` where a mixer sits. A mixer layer stores
whatever tensors its mixer needs (``states`` dict) and counts the tokens it has consumed, so
``get_seq_length`` and mask sizes stay right even for a student with no attention at all.

Rollback (speculative decoding). transformers' protocol is ``cache.activate_past_recording()``
then ``cache.crop(-n)`` to forget the last n tokens (``crop(0)`` commits). A KV layer just drops
rows; a recurrent state cannot be un-mixed. So a recording mixer layer keeps one snapshot of its
state, taken before the first forward after the last crop, plus the *inputs* its mixer saw since
(hidden states, position embeddings, padding mask: a few tokens' worth). ``crop(-n)`` restores the
snapshot and brings it forward over the tokens it keeps, in one of two ways:

* a mixer that can say what its state is after any prefix of a forward hands the layer that
  rule (``set_rollback``; Mamba-2: the SSD state from the x, a, B it computed, the conv state from
  its pre-conv rows, "Mamba in the Llama" §4). The state at the kept position is then computed
  from the snapshot directly, in a few small products, with no mixer weights read again;
* for any other mixer (or a round where one forward gave no rule) the mixer is replayed alone
  over the inputs it keeps: Mamba in the Llama's "cache the inputs, recompute from one snapshot", exact for
  every mixer kind. Both ways give the state of a cache that never saw the undone tokens.
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
        return dataclasses.replace(
            value, **{f.name: _map_state(getattr(value, f.name), fn) for f in dataclasses.fields(value)}
        )
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
        self.record_past = False
        self._snapshot: tuple[int, dict] | None = None  # (seen, states) before the recorded forwards
        self._inputs: list[tuple] = []  # (mixer, hidden (b, l, d), position_embeddings, padding mask)
        self._rollbacks: list = []  # per recorded forward: its mixer's rule (see set_rollback) or None
        self._replaying = False

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
        self._commit()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.states = {
            k: _map_state(v, lambda t: t.index_select(0, beam_idx.to(t.device)))
            for k, v in self.states.items()
        }

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.states = {
            k: _map_state(v, lambda t: t.repeat_interleave(repeats, dim=0)) for k, v in self.states.items()
        }

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.states = {k: _map_state(v, lambda t: t[indices]) for k, v in self.states.items()}

    # -- rollback (see the module docstring) ------------------------------------------------------
    @property
    def is_croppable(self) -> bool:
        return self.record_past

    def activate_past_recording(self) -> None:
        self.record_past = True

    def record(self, mixer, hidden_states, position_embeddings, padding_mask) -> None:
        """Called by a mixer before it updates this layer's state (a no-op unless recording)."""
        if not self.record_past or self._replaying:
            return
        if self._snapshot is None:
            self._snapshot = (self.seen, {k: _map_state(v, torch.clone) for k, v in self.states.items()})
        self._inputs.append((mixer, hidden_states.detach(), position_embeddings, padding_mask))
        self._rollbacks.append(None)

    def set_rollback(self, rule) -> None:
        """Called by a mixer during a recorded forward (after ``record``): ``rule(states, keep)``
        returns the states after the first ``keep`` (1..l) tokens of that forward, given
        ``states``, the states it started from. ``crop`` then needs no replay of this forward."""
        if self.record_past and not self._replaying and self._rollbacks:
            self._rollbacks[-1] = rule

    def _commit(self) -> None:
        self._snapshot, self._inputs, self._rollbacks = None, [], []

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' sign convention); 0 commits."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as transformers does"
            )
        remove = -tokens_to_remove
        if remove == 0:
            self._commit()
            return
        snapshot = self._snapshot
        if snapshot is None or self.seen - remove < snapshot[0]:
            reason = (
                "recording is off"
                if not self.record_past
                else f"only the last {self.seen - (snapshot[0] if snapshot else self.seen)} tokens were recorded"
            )
            raise RuntimeError(
                f"cannot remove {remove} tokens from a recurrent state ({reason}); call cache.activate_past_recording() "
                "before the forwards you may want to undo"
            )
        keep = self.seen - remove - snapshot[0]
        self.seen, self.states = snapshot[0], dict(snapshot[1])
        if keep and all(self._rollbacks):
            self._roll_forward(keep)
        elif keep:
            self._replay(keep)
        self._commit()

    def _roll_forward(self, keep: int) -> None:
        """Bring the snapshot forward over the first ``keep`` recorded tokens by the mixer's rules."""
        for (_, hidden, _, _), rule in zip(self._inputs, self._rollbacks):
            take = min(keep, hidden.shape[1])
            self.states = rule(self.states, take)
            self.advance(take)
            keep -= take
            if not keep:
                return

    def _replay(self, keep: int) -> None:
        """Run the recorded mixer over the first ``keep`` recorded tokens, from the snapshot."""
        mixer = self._inputs[0][0]
        hidden = torch.cat([h for _, h, _, _ in self._inputs], 1)[:, :keep]
        pe = None
        if self._inputs[0][2] is not None:
            pe = tuple(torch.cat(parts, 1)[:, :keep] for parts in zip(*(p for _, _, p, _ in self._inputs)))
        masks = [
            m if m is not None else torch.ones(h.shape[:2], dtype=torch.long, device=h.device)
            for _, h, _, m in self._inputs
        ]
        mask = torch.cat(masks, 1)[:, :keep]
        context, saved = mixer.context, mixer.context.padding_mask
        context.padding_mask = None if bool(mask.all()) else mask
        self._replaying = True
        try:
            with torch.no_grad():
                mixer(hidden, position_embeddings=pe, cache=_OneLayer(self))
        finally:
            context.padding_mask, self._replaying = saved, False

    def state_bytes(self) -> int:
        """Bytes held by this layer's state (constant in the sequence length)."""
        tensors: list[torch.Tensor] = []
        for v in self.states.values():
            _map_state(v, lambda t: tensors.append(t) or t)
        return sum(t.numel() * t.element_size() for t in tensors)


class _OneLayer:
    """Stands in for the cache when a mixer replays its recorded inputs (see ``crop``)."""

    def __init__(self, layer: MixerStateLayer):
        self.layer = layer

    def mixer_layer(self, layer_idx: int) -> MixerStateLayer:
        return self.layer


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
