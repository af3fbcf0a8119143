"""Held-out perplexity with strided windows (every token scored once, with ≥ window−stride context)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def strided_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) triples; token t is predicted from tokens < t inside its window."""
    if window < 2 or not 0 < stride <= window:
        raise ValueError(f"need window >= 2 and 0 < stride <= window, got window={window} stride={stride}")
    spans, prev_end, begin = [], 1, 0  # token 0 has no context and is never scored
    while prev_end < n_tokens:
        end = min(begin + window, n_tokens)
        spans.append((begin, end, prev_end))
        prev_end = end
        begin = max(end - window + stride, begin + stride) if end < n_tokens else end
    return spans


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log p(ids[:, t + 1] | ids[:, :t + 1]) for every position t of ``logits`` (n, l, vocab): (n, l - 1),
    in fp32, the log-softmax taken ``chunk`` positions at a time (at 8,192 tokens and SmolLM2's 49,152
    words a whole one is 1.6 GB more)."""
    out = []
    for s in range(0, logits.shape[1] - 1, chunk):
        e = min(s + chunk, logits.shape[1] - 1)
        logp = F.log_softmax(logits[:, s:e].float(), -1)
        out.append(logp.gather(-1, ids[:, s + 1 : e + 1, None]).squeeze(-1))
    return torch.cat(out, 1) if out else logits.new_zeros(logits.shape[0], 0, dtype=torch.float32)


@torch.no_grad()
def perplexity(
    model,
    ids: torch.Tensor,
    *,
    window: int,
    stride: int | None = None,
    batch_size: int = 4,
    max_tokens: int | None = None,
    progress: bool = False,
    desc: str = "perplexity",
    predictions: bool = False,
) -> dict:
    """Returns {"ppl", "nll", "tokens"} for a 1-D token stream ``ids``.

    ``predictions=True`` adds "argmax": the model's top-1 next-token guess for every scored
    position 1..n-1 (a (n-1,) long tensor, from the same forwards, each position predicted inside
    its own window), so two models scored with the same windows compare position by position.
    """
    stride = stride or max(1, window // 2)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    device = next(model.parameters()).device
    spans = strided_windows(len(ids), window, stride)
    total_nll, total_tokens = 0.0, 0
    argmax = torch.full((len(ids),), -1, dtype=torch.long) if predictions else None
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(spans), desc=desc, disable=not progress, leave=False)
    # Windows of equal length batch together (all but possibly the last one).
    for i in range(0, len(spans), batch_size):
        group = spans[i : i + batch_size]
        by_len: dict[int, list] = {}
        for span in group:
            by_len.setdefault(span[1] - span[0], []).append(span)
        for same in by_len.values():
            batch = torch.stack([ids[b:e] for b, e, _ in same]).to(device)
            logits = model(input_ids=batch, use_cache=False).logits
            logp = token_logprobs(logits, batch)  # (n, l-1)
            for row, (b, e, first) in enumerate(same):
                scored = logp[row, first - b - 1 :]
                total_nll -= scored.sum().item()
                total_tokens += scored.numel()
                if argmax is not None:  # logits at position p predict token p + 1
                    argmax[first:e] = logits[row, first - b - 1 : e - b - 1].argmax(-1).cpu()
        bar.update(len(group))
    bar.close()
    model.train(was_training)
    nll = total_nll / max(total_tokens, 1)
    out = {"ppl": math.exp(nll), "nll": nll, "tokens": total_tokens}
    if argmax is not None:
        out["argmax"] = argmax[1:]
    return out
