"""Decode-mode mixer classes (decode/mixers.py): each computes what the mixer's own ``step`` — its
paper's recurrence — computes, in fewer ops. Held equal here op for op (fp32, one token against a
carried state, with a padded row), for every mixer kind and the families whose heads differ
(GQA, partial rotary, q/k norms); and the one-token features of a Hedgehog map equal its forward."""

import pytest
import torch

from attn2ssm.decode.fusion import FusedLinears
from attn2ssm.decode.layout import cpu_decode_layout, undo_cpu_decode_layout
from attn2ssm.decode.mixers import LinearAttentionDecode, MixerDecode, hedgehog_softmax_step, map_step
from attn2ssm.mixers.feature_maps import HedgehogMap
from attn2ssm.student.cache import _map_state
from cache_forms import positions
from tiny_models import tiny_student

KINDS = [
    ("gqa_9x3", "mamba2", None),
    ("gqa_9x3", "mamba2", {"rope": "before", "norm": True}),
    ("gqa_9x3", "discrete_mamba2", None),
    ("gqa_9x3", "mamba", None),
    ("gqa_9x3", "linear_attention", None),
    ("gqa_9x3", "linear_attention", {"feature_map": "hedgehog"}),
    ("gqa_9x3", "linear_attention", {"feature_map": "cosformer"}),  # position-aware: reads ``seen``
    ("phi", "linear_attention", {"feature_map": "hedgehog"}),  # partial rotary
    ("gemma3", "linear_attention", {"feature_map": "hedgehog"}),  # q/k norms
    ("gqa_9x3", "hedgemamba", None),
    # a softmax window (full after the 6-token prefill): the window step, RoPE before the maps or in the window only
    ("gqa_9x3", "linear_attention", {"feature_map": "hedgehog", "window": 4}),
    (
        "gqa_9x3",
        "linear_attention",
        {"feature_map": "hedgehog", "window": 4, "rope": "window", "decay": True},
    ),
    ("phi", "linear_attention", {"feature_map": "hedgehog", "window": 3, "rope": "window"}),  # partial rotary
]


def _tensors(state) -> list:
    found: list = []
    _map_state(state, lambda t: found.append(t) or t)
    return found


def _rope(mixer, rows: int):
    """Some (cos, sin) of the rotate-half form for the mixer's rotary width (None: no RoPE)."""
    if not mixer.rotary_dim:
        return None
    angle = torch.randn(rows, 1, mixer.rotary_dim // 2, generator=torch.Generator().manual_seed(7))
    angle = torch.cat([angle, angle], -1)
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("mask", [None, [[1], [0]]], ids=["real", "padded"])
@pytest.mark.parametrize("family, kind, options", KINDS)
def test_decode_mode_steps_equal_the_mixers_own_steps(family, kind, options, mask):
    plain = tiny_student(family, kind, options=options)
    fast = tiny_student(family, kind, options=options)  # the same weights
    cpu_decode_layout(fast)
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    pad = torch.ones_like(ids)
    pad[1, :2] = 0  # a left-padded prefill: the carried state of row 1 saw fewer tokens
    cache = plain.new_cache()
    with torch.no_grad():
        plain(ids, attention_mask=pad, position_ids=positions(pad), past_key_values=cache, use_cache=True)
    m = None if mask is None else torch.tensor(mask)
    for i, mixer in plain.mixers().items():
        decode_mode = fast.mixers()[i]
        assert isinstance(decode_mode, MixerDecode) and type(decode_mode)._decode_base is type(mixer)
        assert decode_mode.__dict__.get("_fused_inputs") is not None
        layer = cache.mixer_layer(i)
        assert mixer.can_step(layer) and decode_mode.can_step(layer)
        u = torch.randn(2, 1, mixer.hidden_size, generator=torch.Generator().manual_seed(i))
        pe = _rope(mixer, 2)
        with torch.no_grad():
            want, want_states = mixer.step(
                u,
                pe,
                {k: _map_state(v, torch.clone) for k, v in layer.states.items()},
                mask=m,
                seen=layer.seen,
            )
            got, got_states = decode_mode.step(
                u,
                pe,
                {k: _map_state(v, torch.clone) for k, v in layer.states.items()},
                mask=m,
                seen=layer.seen,
            )
        rows = slice(None) if m is None else slice(0, 1)  # a padded row's output is whatever is cheapest
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
        assert set(got_states) == set(want_states)
        for key in want_states:
            for x, y in zip(_tensors(got_states[key]), _tensors(want_states[key]), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_the_hand_fused_linear_attention_step_reads_one_matmul_and_stacked_maps(monkeypatch):
    """A Hedgehog student's decode step: one fused matmul per mixer (q | k | v), both maps from
    their stacked buffers; a hooked map is read through its call; undo takes it all out."""
    model = tiny_student("gqa_9x3", "linear_attention", options={"feature_map": "hedgehog"})
    cpu_decode_layout(model)
    mixer = model.mixers()[0]
    assert isinstance(mixer, LinearAttentionDecode) and mixer.__dict__.get("_fused_maps") is not None
    calls = []
    original = FusedLinears.matmul
    monkeypatch.setattr(FusedLinears, "matmul", lambda self, x: calls.append(self.names) or original(self, x))
    cache = model.new_cache()
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        calls.clear()
        ref = model(ids[:, :1], past_key_values=cache, use_cache=True).logits
    assert calls.count(["q_proj", "k_proj", "v_proj"]) == len(model.mixers())
    seen = []
    handle = mixer.feature_map_k.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        seen.clear()
        hooked = model(ids[:, :1], past_key_values=cache, use_cache=True).logits
    handle.remove()
    assert seen  # the hook ran in the decode step
    torch.testing.assert_close(hooked, ref, rtol=1e-5, atol=1e-5)
    undo_cpu_decode_layout(model)
    assert type(mixer).__name__ == "LinearAttentionMixer" and "_signed_sin" not in mixer.__dict__


@pytest.mark.parametrize("activation", HedgehogMap.ACTIVATIONS)
def test_hedgehog_one_token_features_equal_forward(activation):
    torch.manual_seed(0)
    fmap = HedgehogMap(3, 8, feature_dim=6, activation=activation)
    with torch.no_grad():
        fmap.weight.add_(0.3 * torch.randn_like(fmap.weight))
        fmap.bias.add_(0.3 * torch.randn_like(fmap.bias))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(map_step(fmap, x, None), fmap(x[:, :, None])[:, :, 0], atol=1e-6, rtol=1e-6)
    if activation == "softmax":
        for rows in (1, 2):
            want = fmap(x[:rows, :, None])[:, :, 0]
            torch.testing.assert_close(
                hedgehog_softmax_step(x[:rows], fmap.weight, fmap.bias), want, atol=1e-6, rtol=1e-6
            )
