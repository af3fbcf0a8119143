"""Speculative decoding for recurrent, hybrid and attention models (paper 004 §4, Algorithm 2).

A draft model proposes K tokens one at a time; the verifier scores them all in ONE forward over
[its pending tokens; d_1..d_K] and keeps the longest acceptable prefix plus one token of its own.
Each model then forgets what it consumed past the accepted text: attention layers drop KV rows,
recurrent layers go back to the snapshot taken before the round and replay their recorded inputs
(``MixerStateLayer.crop``) — so only one state per layer is ever stored. Any attn2ssm student or
any plain HF decoder (the teacher) can be draft or verifier; they must share a tokenizer.

``model.generate(ids, assistant_model=draft)`` also works for students (transformers drives the
same cache protocol); this loop exists for the paper's fixed-K algorithm and its statistics
(acceptance rate, tokens per verifier forward), which the benchmark reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from attn2ssm.errors import ConfigError
from attn2ssm.generation.sampling import accept_greedy, accept_sampled, warp
from attn2ssm.hf_compat import CACHE_KWARG


@dataclass
class SpeculativeStats:
    rounds: int = 0  # verifier forwards after the prompt
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the verifier kept
    generated: int = 0  # tokens emitted (accepted drafts + one verifier token per round)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            **{k: getattr(self, k) for k in self.__dataclass_fields__},
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
        }


@dataclass
class SpeculativeOutput:
    sequences: torch.LongTensor  # (1, prompt + new)
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


class _Runner:
    """One model with its cache and how many tokens of the text it has consumed."""

    def __init__(self, model):
        self.model = model
        self.cache = model.new_cache() if hasattr(model, "new_cache") else DynamicCache(config=model.config)
        self.consumed = 0

    def feed(self, tokens: torch.Tensor, keep: int) -> torch.Tensor:
        """tokens (1, n) → fp32 logits (keep, V) for the last ``keep`` of them."""
        n = tokens.shape[1]
        device = tokens.device
        out = self.model(
            input_ids=tokens,
            attention_mask=torch.ones(1, self.consumed + n, dtype=torch.long, device=device),
            position_ids=torch.arange(self.consumed, self.consumed + n, device=device)[None],
            use_cache=True,
            **{CACHE_KWARG: self.cache},
            logits_to_keep=keep,
        )
        self.consumed += n
        return out.logits[0, -keep:].float()

    def start_round(self) -> None:
        """Everything fed from now on may be undone by ``rollback``."""
        self.cache.activate_past_recording()

    def rollback(self, length: int) -> None:
        """Forget tokens past ``length`` (and commit: the next round snapshots afresh)."""
        if length > self.consumed:
            raise RuntimeError(f"cannot roll forward from {self.consumed} to {length} tokens")
        self.cache.crop(length - self.consumed)
        self.consumed = length


def _check_pair(verifier, draft) -> None:
    vv, dv = verifier.config.get_text_config().vocab_size, draft.config.get_text_config().vocab_size
    if vv != dv:
        raise ConfigError(f"the draft's vocabulary ({dv} tokens) differs from the verifier's ({vv})", "use a draft that shares the verifier's tokenizer (a student of the same teacher)")


@torch.no_grad()
def speculative_generate(
    verifier,
    draft,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 32,
    num_draft_tokens: int = 4,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    streamer=None,
    past_key_values: tuple | None = None,
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` after ``input_ids`` (1, l) with ``draft`` proposing
    ``num_draft_tokens`` tokens per verifier forward. Greedy output equals the verifier's own
    greedy output; sampled output follows the verifier's (warped) distribution.

    ``past_key_values=(verifier_cache, draft_cache)``: caches that already hold every prompt
    token but the last (e.g. copies of one long prefill, to compare settings from one state)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(f"speculative decoding takes one prompt (input_ids of shape (1, l)), got {tuple(input_ids.shape)}", "run prompts one at a time")
    if num_draft_tokens < 1:
        raise ConfigError(f"num_draft_tokens={num_draft_tokens}", "draft at least 1 token per round (2-6 is typical)")
    _check_pair(verifier, draft)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    stats = SpeculativeStats()
    runners = _Runner(verifier), _Runner(draft)
    if past_key_values is not None:
        for runner, cache in zip(runners, past_key_values):
            if cache.get_seq_length() != input_ids.shape[1] - 1:
                raise ConfigError(f"a prefilled cache holds {cache.get_seq_length()} tokens, not the prompt's {input_ids.shape[1] - 1} (all but the last)", "prefill both models on input_ids[:, :-1]")
            runner.cache, runner.consumed = cache, input_ids.shape[1] - 1
    text = input_ids[0].tolist()
    device = input_ids.device
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def pending(runner):
        return torch.tensor([text[runner.consumed :]], device=device)

    # prefill: both models consume all but the last prompt token, which opens the first round
    t0 = time.perf_counter()
    if len(text) > 1 and past_key_values is None:
        for runner in runners:
            runner.feed(input_ids[:, :-1], keep=1)
    stats.prefill_seconds = time.perf_counter() - t0

    new, done = 0, False
    while new < max_new_tokens and not done:
        ver, dra = runners
        k = min(num_draft_tokens, max_new_tokens - new - 1)  # leave room for the verifier's token
        start = len(text)

        # 1. draft k tokens, one forward each (the first also catches up on accepted text)
        t0 = time.perf_counter()
        drafts, q = [], []
        if k:
            dra.start_round()
            logits = dra.feed(pending(dra), keep=1)[-1]
            for i in range(k):
                if do_sample:
                    probs = warp(logits, temperature, top_k, top_p)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                    q.append(probs)
                else:
                    token = int(logits.argmax())
                drafts.append(token)
                if i + 1 < k:
                    logits = dra.feed(torch.tensor([[token]], device=device), keep=1)[-1]
        t1 = time.perf_counter()

        # 2. verify: one forward over [pending; drafts] scores all k drafts and one token beyond
        ver.start_round()
        v_logits = ver.feed(torch.cat([pending(ver), torch.tensor([drafts], dtype=torch.long, device=device)], 1), keep=k + 1)
        d = torch.tensor(drafts, dtype=torch.long, device=v_logits.device)
        if do_sample:
            p = warp(v_logits, temperature, top_k, top_p)
            n, token = accept_sampled(p, torch.stack(q) if q else p[:0], d, generator)
        else:
            n, token = accept_greedy(v_logits, d)
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += time.perf_counter() - t1

        emitted = drafts[:n] + [token]
        for j, t in enumerate(emitted):  # stop at the first end-of-sequence token
            if t in eos:
                emitted, done = emitted[: j + 1], True
                break
        text.extend(emitted)
        new += len(emitted)
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += n
        stats.generated += len(emitted)
        if streamer is not None:
            streamer.put(torch.tensor(emitted))

        # 3. both models forget what they consumed past the accepted text: text[:start] and the
        #    accepted drafts stay, the last emitted token is fed next round. The draft never fed
        #    its own last proposal, so after a full acceptance it is behind and catches up next round.
        keep = start + min(n, len(emitted) - 1)
        for runner in runners:
            runner.rollback(min(runner.consumed, keep))
    if streamer is not None:
        streamer.end()
    return SpeculativeOutput(torch.tensor([text], device=device), stats)
