"""Run a student three ways for the cache tests: one full forward, and the same tokens fed in pieces
through ``model.new_cache()`` (chunked prefill, or a prefill then one token at a time); greedy
decoding without any cache as the reference for ``generate``; and a saved student run in a
process that cannot import attn2ssm (remote code)."""

import json
import subprocess
import sys

import torch

# Prepended to remote-code scripts: any attempt to import attn2ssm fails; `d` is the checkpoint.
REMOTE_PRELUDE = """
import sys, json, torch
sys.modules["attn2ssm"] = None
from transformers import AutoModelForCausalLM
d = sys.argv[1]
"""


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def padded_batch(length: int, gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of two rows of ``length`` random tokens (seed 3): the second row left-padded by two
    tokens and with a padded token at ``gap`` (among the decoded ones)."""
    ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    mask[1, gap] = 0  # and a padded token among the decoded ones
    return ids, mask


def full_and_pieces(model, ids, mask, pieces):
    """(logits of one full forward, logits of the pieces run through a cache, concatenated)."""
    pos = positions(mask)
    full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    cache, outs, start = model.new_cache(), [], 0
    for size in pieces:
        end = start + size
        out = model(
            input_ids=ids[:, start:end],
            attention_mask=mask[:, :end],
            position_ids=pos[:, start:end],
            past_key_values=cache,
            use_cache=True,
        )
        outs.append(out.logits)
        start = end
    return full, torch.cat(outs, 1)


@torch.no_grad()
def greedy_by_full_forwards(model, ids, n):
    """``ids`` followed by ``n`` greedy tokens, each from a full forward without a cache."""
    seq = ids
    for _ in range(n):
        seq = torch.cat(
            [seq, model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1
        )
    return seq


def run_remote(script: str, directory) -> dict:
    """Run ``REMOTE_PRELUDE + script`` on ``directory`` in a fresh interpreter; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_PRELUDE + script, str(directory)],
        capture_output=True,
        text=True,
        cwd=directory,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
