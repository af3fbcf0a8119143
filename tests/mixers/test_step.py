"""Every mixer's ONE one-token path, ``step``: its forward runs it for every one-token call with
states, padded or not (the decode plan and the compiled step run the same function, see
tests/decode). Held equal here to the chunked prefill over the same tokens, with padding in the
middle of the decoded tokens, with and without the CPU decode layout (fused projections, plan);
a padded row's recurrent state stays as it was, and a padded batch's real row gives what the
same row gives alone (the unpadded step)."""

import pytest
import torch

from attn2ssm.decode.layout import cpu_decode_layout
from attn2ssm.student.cache import _map_state
from cache_forms import padded_batch, positions
from tiny_models import tiny_student

KINDS = [
    ("mamba2", None),
    ("discrete_mamba2", None),
    ("mamba", None),
    ("linear_attention", None),
    ("linear_attention", {"feature_map": "hedgehog"}),
    ("linear_attention", {"feature_map": "cosformer"}),  # position-aware: the step reads ``seen``
    ("hedgemamba", None),
]
# the scan's state (a conv window takes a zero for a padded token, as the chunked form)
RECURRENT = {"ssm", "linear"}


def _tensors(state) -> list:
    found: list = []
    _map_state(state, lambda t: found.append(t) or t)
    return found


@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("kind, options", KINDS)
def test_one_token_steps_with_padding_equal_the_chunked_prefill(kind, options, layout):
    model = tiny_student("gqa_9x3", kind, options=options)
    if layout:
        cpu_decode_layout(model)
    ids, mask = padded_batch(10, gap=6)
    pos = positions(mask)
    real = mask.bool()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        cache = model.new_cache()
        out = model(
            input_ids=ids[:, :4],
            attention_mask=mask[:, :4],
            position_ids=pos[:, :4],
            past_key_values=cache,
            use_cache=True,
        )
        steps = [out.logits]
        for t in range(4, 10):
            before = {
                i: {k: [x.clone() for x in _tensors(v)] for k, v in cache.mixer_layer(i).states.items()}
                for i in model.mixers()
            }
            out = model(
                input_ids=ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                position_ids=pos[:, t : t + 1],
                past_key_values=cache,
                use_cache=True,
            )
            steps.append(out.logits)
            if not real[1, t]:  # the padded row's recurrent state is left as it was
                for i in model.mixers():
                    for name, old in before[i].items():
                        if name in RECURRENT:
                            for x, y in zip(old, _tensors(cache.mixer_layer(i).states[name]), strict=True):
                                torch.testing.assert_close(y[1], x[1], rtol=0, atol=0)
    stepped = torch.cat(steps, 1)
    torch.testing.assert_close(stepped[real], full[real], rtol=1e-4, atol=1e-4)
    # the real row of the padded batch: what the same row gives alone, without any mask
    with torch.no_grad():
        cache = model.new_cache()
        alone = [model(input_ids=ids[:1, :4], past_key_values=cache, use_cache=True).logits]
        for t in range(4, 10):
            alone.append(model(input_ids=ids[:1, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(stepped[:1], torch.cat(alone, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, options", KINDS)
def test_every_one_token_forward_runs_the_step(kind, options, monkeypatch):
    """No second one-token path: a one-token call with states, padded or not, is ``step``."""
    model = tiny_student("gqa_9x3", kind, options=options)
    mixer_class = type(next(iter(model.mixers().values())))
    calls = []
    original = mixer_class.step

    def counting(self, *args, **kwargs):
        calls.append(kwargs.get("mask") is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(mixer_class, "step", counting)
    ids, mask = padded_batch(10, gap=6)
    with torch.no_grad():
        cache = model.new_cache()
        model(input_ids=ids[:, :4], attention_mask=mask[:, :4], past_key_values=cache, use_cache=True)
        assert calls == []  # a prefill is the chunked form
        model(input_ids=ids[:, 4:5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True)
        model(
            input_ids=ids[:, 5:6],
            attention_mask=torch.cat([mask[:, :5], torch.tensor([[1], [0]])], 1),
            past_key_values=cache,
            use_cache=True,
        )
    n = len(model.mixers())
    assert calls == [False] * n + [True] * n
