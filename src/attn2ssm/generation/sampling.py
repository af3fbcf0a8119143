"""Token choice for our own decoding loops: logits warping and the speculative acceptance rules.

``warp`` applies temperature, then top-k, then top-p, in the order transformers' sampling uses,
so a speculative run and ``model.generate(do_sample=True, ...)`` sample from the same distribution.

Acceptance (Mamba in the Llama §4 / Leviathan et al. 2023). The draft proposes d_1..d_K, sampled from its
warped distributions q_1..q_K; the verifier scores all of them in one forward, giving p_1..p_{K+1}.
- greedy: accept while d_i == argmax p_i; the next token is argmax p at the first mismatch (or
  p_{K+1} if every draft matched), so the output is exactly the verifier's greedy output.
- sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw
  from norm(max(0, p_i - q_i)); if all K are accepted draw a bonus token from p_{K+1}. Each emitted
  token is then distributed exactly as the verifier's p, whatever the draft.
"""

from __future__ import annotations

import math

import torch

from attn2ssm.errors import ConfigError


def check_sampling(
    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, *, cli: bool = False
) -> None:
    """Sampling settings in range: temperature >= 0 (0: greedy), top_k >= 0 (0: off), 0 < top_p <= 1.
    ``cli`` names them as ``generate``'s flags (``--top-p 2.0``), else as arguments (``top_p=2.0``)."""

    def name(key, value):
        return f"--{key.replace('_', '-')} {value}" if cli else f"{key}={value}"

    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(
            f"{name('temperature', temperature)} is not a temperature",
            f"use {name('temperature', 0)} for greedy decoding, or a positive value such as 0.8 to sample",
        )
    if top_k is not None and top_k < 0:
        raise ConfigError(
            f"{name('top_k', top_k)} is negative",
            f"keep the k most likely tokens, e.g. {name('top_k', 50)} (0: no top-k filter)",
        )
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(
            f"{name('top_p', top_p)} is outside (0, 1]",
            f"keep the tokens that make up that much probability, e.g. {name('top_p', 0.9)} (1: no top-p filter)",
        )


def warp(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """logits (..., V) → probabilities (..., V) in fp32 after temperature, top-k and top-p."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling (use greedy decoding for temperature 0)")
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top one always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def accept_greedy(verifier_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """verifier_logits (K+1, V), drafts (K,) → (number of drafts accepted, next token)."""
    best = verifier_logits.argmax(-1)
    k = drafts.shape[0]
    mismatch = (best[:k] != drafts).nonzero()
    n = int(mismatch[0]) if len(mismatch) else k
    return n, int(best[n])


def accept_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """p (K+1, V) verifier probabilities, q (K, V) the draft's, drafts (K,) → (accepted, next token)."""
    k = drafts.shape[0]
    u = torch.rand(k, generator=generator, device=p.device) if k else None
    for i in range(k):
        d = int(drafts[i])
        if u[i] * q[i, d] <= p[i, d]:  # accept with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        # total == 0 only when p_i == q_i, and then a rejection has probability 0; guard rounding
        residual = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))
