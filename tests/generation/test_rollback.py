"""Cache rollback: ``activate_past_recording`` then ``crop(-n)`` puts every layer kind — KV, sliding
window KV, and each mixer's recurrent + conv state — back to where it was n tokens ago, so the
next tokens give the same logits as a run that never saw the undone ones."""

import pytest
import torch

from attn2ssm.mixers.registry import MIXERS
from cache_forms import positions
from tiny_models import tiny_student

KINDS = sorted(MIXERS)


def _feed(model, cache, ids, mask, start, end):
    pos = positions(mask)
    return model(
        input_ids=ids[:, start:end],
        attention_mask=mask[:, :end],
        position_ids=pos[:, start:end],
        past_key_values=cache,
        use_cache=True,
    ).logits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,ratio", [("llama", 0.0), ("mistral", 0.5), ("gemma2", 0.5)])
@pytest.mark.parametrize("remove", [1, 3, 6])
def test_crop_then_continue_equals_never_seen(kind, family, ratio, remove):
    """Prefill 6 real tokens, speculate 6 more in pieces (the first 6 - remove real, the rest
    wrong), undo ``remove``, then feed the true continuation: logits equal one full forward."""
    student = tiny_student(family, kind, ratio)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    real = mask.bool()
    kept = 12 - remove
    spec = ids.clone()
    spec[:, kept:12] = (ids[:, kept:12] + 1) % 256  # wrong guesses, to be undone
    with torch.no_grad():
        full = student(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False
        ).logits
        cache = student.new_cache()
        _feed(student, cache, ids, mask, 0, 6)  # prefill, longer than the sliding window (4)
        cache.activate_past_recording()
        spec_logits = torch.cat(
            [_feed(student, cache, spec, mask, a, b) for a, b in ((6, 9), (9, 10), (10, 12))], 1
        )
        cache.crop(-remove)
        assert cache.get_seq_length() == kept
        rest = torch.cat(
            [_feed(student, cache, ids, mask, kept, 14), _feed(student, cache, ids, mask, 14, 16)], 1
        )
    got = torch.cat([spec_logits[:, : kept - 6], rest], 1)
    torch.testing.assert_close(got[real[:, 6:]], full[:, 6:][real[:, 6:]], atol=1e-4, rtol=1e-4)


def test_crop_past_the_recording_is_a_clear_error():
    student = tiny_student("llama", "mamba2", 0.0)
    ids = torch.randint(0, 256, (1, 8))
    cache = student.new_cache()
    with torch.no_grad():
        student(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="activate_past_recording"):
            cache.crop(-1)
        cache.activate_past_recording()
        student(input_ids=ids[:, 4:6], past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="only the last 2 tokens"):
            cache.crop(-3)
        with pytest.raises(ValueError, match="negative"):
            cache.crop(2)
        cache.crop(0)  # commits: nothing left to undo
        with pytest.raises(RuntimeError, match="only the last 0 tokens"):
            cache.crop(-1)


def test_recorded_inputs_are_bounded_by_commits():
    """Each crop commits, so a long speculative run keeps one snapshot and a few tokens' inputs."""
    student = tiny_student("llama", "linear_attention", 0.0)
    cache = student.new_cache()
    cache.activate_past_recording()
    with torch.no_grad():
        for _ in range(5):
            student(input_ids=torch.randint(0, 256, (1, 3)), past_key_values=cache, use_cache=True)
            cache.crop(-1)
    layer = cache.layers[0]
    assert layer._inputs == [] and layer._snapshot is None and cache.get_seq_length() == 10


@pytest.mark.parametrize("family,ratio", [("llama", 0.0), ("mistral", 0.5)])
def test_mamba2_rollback_by_rule_equals_replay_and_never_fed(family, ratio, monkeypatch):
    """Mamba in the Llama §4 rollback: after a 5-token verify forward, ``crop`` to keep j tokens
    (every j) by the Mamba-2 mixer's own rule (``ssd_state`` / ``causal_conv1d_state`` from the
    snapshot, no replay) gives the states and next-token logits of (a) the replay of the kept
    inputs and (b) a cache that was only ever fed the kept tokens."""
    from attn2ssm.student.cache import MixerStateLayer

    student = tiny_student(family, "mamba2", ratio)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))

    def run(keep, rule=True, fed_only_kept=False):
        cache = student.new_cache()
        with torch.no_grad():
            student(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)
            if fed_only_kept:
                if keep:
                    student(input_ids=ids[:, 6 : 6 + keep], past_key_values=cache, use_cache=True)
            else:
                cache.activate_past_recording()
                student(input_ids=ids[:, 6:11], past_key_values=cache, use_cache=True)
                layers = [layer for layer in cache.layers if isinstance(layer, MixerStateLayer)]
                assert all(bool(layer._rollbacks[0]) for layer in layers)  # the rule was handed over
                if not rule:
                    for layer in layers:
                        layer._rollbacks = [None]
                cache.crop(keep - 5)
            assert cache.get_seq_length() == 6 + keep
            states = [dict(layer.states) for layer in cache.layers if isinstance(layer, MixerStateLayer)]
            nxt = student(input_ids=ids[:, 11:12], past_key_values=cache, use_cache=True).logits
        return states, nxt

    for keep in range(6):
        by_rule, by_replay, never = run(keep), run(keep, rule=False), run(keep, fed_only_kept=True)
        for other in (by_replay, never):
            for mine, theirs in zip(by_rule[0], other[0]):
                assert mine.keys() == theirs.keys()
                for name in mine:
                    torch.testing.assert_close(mine[name], theirs[name], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(by_rule[1], other[1], atol=1e-5, rtol=1e-5)
