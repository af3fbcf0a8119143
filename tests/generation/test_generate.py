"""``model.generate`` on students of every mixer kind, pure and hybrid (with sliding-window
attention layers kept): greedy equals argmax over repeated full forwards, a left-padded batch
equals each prompt alone, sampling options, EOS stopping and streaming."""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from attn2ssm.mixers.registry import MIXERS
from cache_forms import greedy_by_full_forwards
from tiny_models import tiny_student

KINDS = sorted(MIXERS)
NEW = 8


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (1, n), generator=g) for n in (7, 4)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,ratio", [("llama", 0.0), ("gemma2", 0.5)])
def test_greedy_batched_left_padded_equals_each_prompt_alone(kind, family, ratio):
    model = tiny_student(family, kind, ratio)
    a, b = _prompts()
    batch = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 3:], mask[1, 3:] = b[0], 1
    out = model.generate(
        input_ids=batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0
    )
    for row, prompt in enumerate((a, b)):
        alone = greedy_by_full_forwards(model, prompt, NEW)  # no cache at all: the reference
        assert out[row, 7:].tolist() == alone[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_options_eos_and_streaming(kind):
    model = tiny_student("llama", kind, 0.5)
    prompt = _prompts()[0]
    greedy = model.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    # top_k = 1 sampling is greedy
    assert torch.equal(
        model.generate(prompt, max_new_tokens=NEW, do_sample=True, top_k=1, pad_token_id=0), greedy
    )
    # seeded sampling with temperature / top-p is reproducible and stays inside the top-k set
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(
            model.generate(
                prompt,
                max_new_tokens=NEW,
                do_sample=True,
                temperature=0.8,
                top_p=0.9,
                top_k=20,
                pad_token_id=0,
            )
        )
    assert torch.equal(runs[0], runs[1]) and runs[0].shape[1] == prompt.shape[1] + NEW
    # EOS: stop at the first time greedy emits the chosen token
    new = greedy[0, prompt.shape[1] :].tolist()
    eos = new[4]
    stopped = model.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert stopped[0, prompt.shape[1] :].tolist() == new[: new.index(eos) + 1]

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            pass

    streamer = Collect()
    model.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0, streamer=streamer)
    assert streamer.tokens == greedy[0].tolist()  # prompt first, then each new token


def test_plain_call_builds_a_cache():
    """``model(ids)`` with no use_cache argument works like an HF model (returns a cache)."""
    model = tiny_student("llama", "mamba2", 0.5)
    out = model(_prompts()[0])
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 7


@pytest.mark.parametrize("kind", KINDS)
def test_beam_search_with_the_cache_equals_beam_search_without(kind):
    """Beam search reorders every layer's cache (KV, sliding window, recurrent and conv state) by
    the surviving beams each step; with ``use_cache=False`` every step re-runs the whole sequence.
    The beams' tokens and their scores (sums of log-probabilities, which a state carried into the
    wrong beam changes even where a tiny random model repeats the same token) must agree."""
    model = tiny_student("gemma2", kind, 0.5)
    prompt = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    kwargs = dict(
        max_new_tokens=10,
        num_beams=4,
        num_return_sequences=2,
        do_sample=False,
        pad_token_id=0,
        length_penalty=0.0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kwargs)
        uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.sequences.shape == (4, 16)
    assert cached.sequences.tolist() == uncached.sequences.tolist()
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "kind", "ratio", "options", "limited"),
    [
        ("llama", "mamba2", 0.0, None, False),
        ("llama", "discrete_mamba2", 0.0, None, False),
        ("llama", "mamba", 0.0, None, False),
        ("llama", "mamba2", 0.5, None, True),  # a kept attention layer
        ("llama", "mamba2", 0.0, {"rope": "before"}, True),
        ("llama", "linear_attention", 0.0, None, True),  # mixers rotating with RoPE
        ("llama", "linear_attention", 0.0, {"rope": "none"}, False),
        ("llama", "hedgemamba", 0.0, {"rope": "none"}, False),
        ("gpt2", "mamba2", 0.0, None, True),  # learned absolute positions (wpe)
    ],
)
def test_position_limit(family, kind, ratio, options, limited):
    """A student bounded by positions reads at most its teacher's max_position_embeddings; one with
    none (Mamba-style mixers only, no RoPE, no position table) has no limit, and decodes past it."""
    from attn2ssm.student.loading import position_limit

    model = tiny_student(family, kind, ratio, options)
    assert position_limit(model.config) == (model.config.max_position_embeddings if limited else None)
    # a plain transformers model: its own
    assert position_limit(model.base.config) == model.config.max_position_embeddings
    if not limited:
        prompt = torch.randint(
            3, 256, (1, model.config.max_position_embeddings + 4), generator=torch.Generator().manual_seed(0)
        )
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert (
            out[0, prompt.shape[1] :].tolist()
            == greedy_by_full_forwards(model, prompt, 4)[0, prompt.shape[1] :].tolist()
        )
