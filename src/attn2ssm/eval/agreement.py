"""Generation agreement: does the student *generate* like its teacher, not just score like it?

On held-out prompts, the teacher's greedy continuation is the reference. For the student:
- ``free`` — its own greedy continuation against the reference: token agreement (same token at
  the same position), the length of the common prefix, and ROUGE-L F1 over tokens (longest
  common subsequence), which forgives a shifted but similar continuation;
- ``forced`` — teacher forcing on the reference: how often the student's argmax equals the
  teacher's next token, which isolates per-step agreement from compounding drift.
A model with good perplexity but broken decoding (e.g. a cache bug, or repetition loops) shows
up here and not in perplexity.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm


def lcs_length(a: list, b: list) -> int:
    """Longest common subsequence length (O(len(a)·len(b)) dynamic programme)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: list, reference: list) -> float:
    """ROUGE-L F1 (β = 1) between two token lists."""
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(candidate), lcs / len(reference)
    return 2 * p * r / (p + r)


def prefix_match(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def heldout_prompts(ids: torch.Tensor, n: int, prompt_len: int, new_tokens: int) -> list[torch.Tensor]:
    """``n`` prompts of ``prompt_len`` tokens spread evenly over a held-out stream, each followed by
    at least ``new_tokens`` tokens of real text (unused, but keeps prompts away from the end)."""
    span = prompt_len + new_tokens
    if ids.numel() < span:
        raise ValueError(f"held-out text has {ids.numel()} tokens, fewer than prompt + continuation ({span})")
    starts = torch.linspace(0, ids.numel() - span, n).long().unique().tolist()
    return [ids[s : s + prompt_len] for s in starts]


@torch.no_grad()
def greedy_continuation(model, prompt: torch.Tensor, new_tokens: int, pad_id: int) -> list[int]:
    """The ``new_tokens`` ids ``model`` continues the 1-D ``prompt`` with, greedily (exactly that many)."""
    ids = prompt[None].to(next(model.parameters()).device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out[0, ids.shape[1] :].tolist()


@torch.no_grad()
def generation_agreement(
    student,
    teacher,
    prompts: list[torch.Tensor],
    new_tokens: int = 32,
    pad_id: int = 0,
    progress: bool = True,
    references: list[list[int]] | None = None,
) -> dict:
    """Mean agreement of ``student`` with ``teacher`` over ``prompts`` (1-D token tensors).
    ``references`` (the teacher's continuations) can be passed to skip regenerating them."""
    rows = []
    for i, prompt in enumerate(tqdm(prompts, desc="generation agreement", disable=not progress, leave=False)):
        ref = (
            references[i]
            if references is not None
            else greedy_continuation(teacher, prompt, new_tokens, pad_id)
        )
        mine = greedy_continuation(student, prompt, new_tokens, pad_id)
        full = torch.cat([prompt, torch.tensor(ref)])[None].to(next(student.parameters()).device)
        logits = student(input_ids=full, use_cache=False).logits[0, prompt.numel() - 1 : -1]
        forced = (logits.argmax(-1).cpu() == torch.tensor(ref)).float().mean().item()
        rows.append(
            {
                "token_agreement": sum(x == y for x, y in zip(mine, ref)) / len(ref),
                "prefix_match": prefix_match(mine, ref),
                "rouge_l": rouge_l(mine, ref),
                "forced_agreement": forced,
                "student": mine,
                "teacher": ref,
            }
        )
    keys = ("token_agreement", "prefix_match", "rouge_l", "forced_agreement")
    return {
        **{k: sum(r[k] for r in rows) / len(rows) for k in keys},
        "prompts": len(rows),
        "new_tokens": new_tokens,
        "examples": rows,
    }
