"""Drafters for speculative decoding: what proposes the tokens a target verifies.

Two kinds, behind one small interface (``start`` once per prompt, ``propose`` each round,
``accept`` after the target's verdict), so ``speculative_generate`` has one loop for both:

- ``NgramDrafter`` (prompt lookup): no model. The last n tokens of the text (n from ``max_n``
  down to ``min_n``) are looked up in the text so far (prompt + generated); at their most
  recent earlier occurrence, the tokens that followed are proposed. A continuation that runs
  into the end of the text (the text is periodic there: a loop) goes on by looking up again
  from the proposed tokens, so a lookup that finds anything proposes k tokens; one that finds
  nothing proposes none, and the round verifies one token: plain decoding. It costs a few
  dictionary lookups per round.
- ``ModelDrafter``: any attn2ssm student or HF decoder sharing the target's tokenizer drafts k
  tokens one forward each (Mamba in the Llama §4: a much cheaper model than the target, e.g. a shallow
  student, ``recipes/draft_shallow.yaml``), rolled back like the target where drafts are rejected.

A proposal is the drafted tokens and, when sampling, the distribution each was drawn from (for
the acceptance rule); a lookup's tokens are deterministic, so that is one-hot.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from attn2ssm.errors import ConfigError
from attn2ssm.generation.sampling import warp
from attn2ssm.hf_compat import CACHE_KWARG


class Runner:
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


class Drafter:
    """The interface ``speculative_generate`` drives (see the module docstring)."""

    name = "drafter"

    def start(self, input_ids: torch.LongTensor, cache=None) -> None:
        """A new prompt (1, l). ``cache``: one that already holds all of it but the last token."""

    def propose(
        self, text: list[int], k: int, sampling: dict | None, generator
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Up to ``k`` tokens to follow ``text``; with ``sampling`` (warp's keywords) also the
        distribution (V,) each token was drawn from."""
        raise NotImplementedError

    def accept(self, length: int) -> None:
        """The text is now ``length`` tokens long, its drafts verified: forget anything past it."""


class NgramDrafter(Drafter):
    """Prompt-lookup drafting (see the module docstring). The index maps every n-gram of the
    text that has a successor to its latest start, built incrementally as the text grows."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1, vocab_size: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ConfigError(
                f"n-gram drafting with min_n={min_n}, max_n={max_n}",
                "use 1 <= min_n <= max_n, e.g. min_n=1, max_n=3",
            )
        self.max_n, self.min_n, self.vocab_size = max_n, min_n, vocab_size
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before text[indexed] are in the index

    def start(self, input_ids: torch.LongTensor, cache=None) -> None:
        self.index, self.indexed = {}, 0

    def _extend(self, text: list[int]) -> None:
        # an n-gram text[j:j+n] is indexed once its successor text[j+n] exists
        for end in range(self.indexed + 1, len(text)):  # end = j + n, the successor's position
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.index[tuple(text[end - n : end])] = end - n
        self.indexed = max(self.indexed, len(text) - 1)

    def lookup(self, text: list[int], tail: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the longest suffix of ``text + tail`` seen in ``text``."""
        seq = text[len(text) - self.max_n :] + tail if len(tail) < self.max_n else tail
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self.index.get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return text[start + n : start + n + k]
        return []

    def propose(self, text, k, sampling, generator):
        self._extend(text)
        drafts: list[int] = []
        while len(drafts) < k:
            more = self.lookup(text, drafts, k - len(drafts))
            if not more:
                break
            drafts.extend(more)
        probs = []
        if sampling is not None and drafts:
            eye = torch.zeros(len(drafts), self.vocab_size)
            eye[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
            probs = list(eye)
        return drafts, probs


class ModelDrafter(Drafter):
    """A draft model: its own cache, k forwards of one token per round (the first also catches
    up on the tokens accepted since), rolled back to the accepted text after each verdict."""

    def __init__(self, model):
        self.model = model
        self.name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.runner: Runner | None = None

    def start(self, input_ids, cache=None):
        self.runner = Runner(self.model)
        if cache is not None:
            self.runner.cache, self.runner.consumed = cache, input_ids.shape[1] - 1
        elif input_ids.shape[1] > 1:
            self.runner.feed(input_ids[:, :-1], keep=1)

    def propose(self, text, k, sampling, generator):
        runner, device = self.runner, self.model.device
        runner.start_round()
        logits = runner.feed(torch.tensor([text[runner.consumed :]], device=device), keep=1)[-1]
        drafts, probs = [], []
        for i in range(k):
            if sampling is not None:
                p = warp(logits, **sampling)
                token = int(torch.multinomial(p, 1, generator=generator))
                probs.append(p)
            else:
                token = int(logits.argmax())
            drafts.append(token)
            if i + 1 < k:
                logits = runner.feed(torch.tensor([[token]], device=device), keep=1)[-1]
        return drafts, probs

    def accept(self, length):
        # the draft never fed its own last proposal, so after a full acceptance it is behind
        # and catches up next round
        self.runner.rollback(min(self.runner.consumed, length))


def make_drafter(draft, vocab_size: int) -> Drafter:
    """A ``Drafter`` from what a caller passes: one itself, ``"ngram"`` (prompt lookup, n = 3..1),
    ``"ngram:N"`` (n = N..1) or a model."""
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str):
        kind, _, n = draft.partition(":")
        if kind != "ngram" or (n and not n.isdigit()):
            raise ConfigError(
                f"unknown drafter {draft!r}",
                "pass a draft model, 'ngram' or 'ngram:N' (prompt lookup of the last N..1 tokens)",
            )
        return NgramDrafter(max_n=int(n) if n else 3, vocab_size=vocab_size)
    config = getattr(draft, "config", None)
    if config is None:
        raise ConfigError(f"a draft of type {type(draft).__name__}", "pass a model, 'ngram' or a Drafter")
    dv = config.get_text_config().vocab_size
    if dv != vocab_size:
        raise ConfigError(
            f"the draft's vocabulary ({dv} tokens) differs from the target's ({vocab_size})",
            "use a draft that shares the target's tokenizer (a student of the same teacher)",
        )
    return ModelDrafter(draft)
