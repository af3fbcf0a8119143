"""Perplexity's log-probabilities taken a chunk of positions at a time equal the whole log-softmax."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attn2ssm.eval.perplexity import token_logprobs


def test_chunked_logprobs_equal_the_whole_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 11, 7, generator=g)
    ids = torch.randint(0, 7, (2, 11), generator=g)
    whole = F.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    for chunk in (1, 3, 10, 64):
        assert torch.allclose(token_logprobs(logits, ids, chunk=chunk), whole, atol=1e-6)
    assert token_logprobs(logits[:, :1], ids[:, :1]).shape == (2, 0)


def test_uniform_logits_give_log_vocab():
    logits = torch.zeros(1, 5, 8, dtype=torch.bfloat16)
    out = token_logprobs(logits, torch.zeros(1, 5, dtype=torch.long), chunk=2)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.full((1, 4), -math.log(8)))
