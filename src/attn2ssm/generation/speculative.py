"""Speculative decoding for recurrent, hybrid and attention targets (Mamba in the Llama §4, Algorithm 2).

A drafter proposes up to K tokens; the target scores them all in ONE forward over [its pending
token; d_1..d_K] and keeps the longest acceptable prefix plus one token of its own. The target
then forgets what it consumed past the accepted text: attention layers drop KV rows, recurrent
layers go back to the snapshot taken before the round and replay their recorded inputs
(``MixerStateLayer.crop``; a Mamba-2 layer computes its state at the kept position from the
snapshot without a replay, Mamba in the Llama §4), so only one state per layer is ever stored.

As in the paper the target is the student (a pure Mamba-2 or a hybrid) and the draft something
much cheaper (generation/drafters.py): prompt lookup (``draft="ngram"``, no model at all) or a
small model sharing the tokenizer (a shallow student of the same teacher; any attn2ssm student or
plain HF decoder works). A round whose drafter has nothing to propose verifies one token: plain
decoding, through the target's one-token fast path where it has one (recording for rollback is
switched on only for rounds with drafts).

``num_draft_tokens="auto"`` picks K before every round (``DraftLength``): the K (0 = a plain
step) that maximises expected tokens per second, from the acceptance rate and round times it has
measured so far in this call. A fixed K costs more than it returns wherever the drafts are
rarely right: a verify forward of K+1 tokens costs ~1.7x a plain step on the 2-core CPU
(README "Speculative decoding"), so at an acceptance under ~0.4 drafting is a slowdown.

``model.generate(ids, assistant_model=draft)`` also works for students (transformers drives the
same cache protocol); this loop exists for the paper's fixed-K algorithm, for drafters that are
not models, and for its statistics (acceptance rate, tokens per target forward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attn2ssm.errors import ConfigError
from attn2ssm.generation.drafters import Drafter, NgramDrafter, Runner, make_drafter
from attn2ssm.generation.sampling import accept_greedy, accept_sampled, check_sampling, warp
from attn2ssm.student.cache import MixerStateLayer


@dataclass
class SpeculativeStats:
    rounds: int = 0  # target forwards after the prompt
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target kept
    generated: int = 0  # tokens emitted (accepted drafts + one target token per round)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_lengths: dict = field(default_factory=dict)  # k → rounds that verified k drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    def add_round(self, drafted: int, accepted: int, generated: int) -> None:
        """Count one round: ``drafted`` drafts verified, ``accepted`` of them kept, ``generated`` tokens emitted."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.generated += generated
        self.draft_lengths[drafted] = self.draft_lengths.get(drafted, 0) + 1

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


AUTO = "auto"
AUTO_MAX_DRAFTS = 7  # a verify forward of <= 8 tokens keeps the few-row products (ops/rows.MAX_ROWS)


class DraftLength:
    """``num_draft_tokens="auto"``: before each round, the number of drafts k in 0..max_k with the
    most expected tokens per second of round time,

        tokens(k) = 1 + α + … + α^k          (each draft kept with probability α, until the first miss)
        seconds(k) = verify(k) + k · draft       (the target's forward and rollback, and drafting)

    verify(k): the target's time measured for k (a moving average; an unmeasured k is interpolated
    between measured ones, or priced by a prior of (1.7 + 0.05 k) plain steps); draft: seconds per
    drafted token, from rounds that followed a round with drafts (after plain rounds a model draft
    first catches up on the tokens it skipped, a cost that drafting every round does not pay),
    prior 0.4 plain steps for a model (a shallow student is ~0.37x its target), 0 for lookup.
    α from the rounds so far (kept / tried drafts, older rounds weighing less; prior 0.6). A free
    drafter (prompt lookup) is also asked in rounds without drafts, and whether its first token
    was the target's own updates α, so the policy sees when lookup starts paying again; a model
    drafter (whose proposals cost) gets one draft every ``probe_every`` rounds instead."""

    DECAY, SMOOTH = 0.9, 0.3
    PRIOR_VERIFY, PRIOR_PER_DRAFT = 1.7, 0.05  # a (k+1)-token verify in plain steps (2-core CPU, measured)
    PRIOR_DRAFT_MODEL = 0.4  # a model draft's token in plain steps of the target

    def __init__(self, max_k: int = AUTO_MAX_DRAFTS, free: bool = True, probe_every: int = 8):
        self.max_k, self.free, self.probe_every = max_k, free, probe_every
        self.kept, self.tried = 1.2, 2.0  # α's prior: 0.6, worth two drafts
        self.seconds: dict[int, float] = {}  # k → moving average of the target's seconds in a round (verify)
        self.draft: float | None = 0.0 if free else None  # moving average of seconds per drafted token
        self.plain_run = 0  # rounds without drafts in a row

    @property
    def alpha(self) -> float:
        return self.kept / self.tried

    def _round_seconds(self, k: int) -> float | None:
        """Seconds of a round with k drafts: measured, else interpolated between the measured k >= 1
        around it, else extrapolated from the nearest one by the prior's cost per draft."""
        if k in self.seconds:
            return self.seconds[k]
        plain = self.seconds.get(0)
        drafted = [j for j in self.seconds if j >= 1]
        if k == 0 or not drafted:
            return (
                None
                if plain is None
                else plain * (1.0 if k == 0 else self.PRIOR_VERIFY + self.PRIOR_PER_DRAFT * k)
            )
        lo = max((j for j in drafted if j < k), default=None)
        hi = min((j for j in drafted if j > k), default=None)
        if lo is not None and hi is not None:
            w = (k - lo) / (hi - lo)
            return (1 - w) * self.seconds[lo] + w * self.seconds[hi]
        j = lo if lo is not None else hi
        per_draft = self.PRIOR_PER_DRAFT * (
            plain if plain is not None else self.seconds[j] / self.PRIOR_VERIFY
        )
        return self.seconds[j] + (k - j) * per_draft

    def expected_tokens(self, k: int) -> float:
        a = min(self.alpha, 1 - 1e-6)
        return (1 - a ** (k + 1)) / (1 - a)

    def choose(self, room: int) -> int:
        """k for the next round, at most ``room``."""
        limit = min(self.max_k, room)
        if limit < 1:
            return 0
        if not self.free and self.plain_run >= self.probe_every:
            return 1
        plain = self.seconds.get(0)
        if plain is None:  # no plain step timed yet: seconds in plain steps, by the priors
            draft = self.PRIOR_DRAFT_MODEL if self.draft is None else 0.0
            cost = {
                k: 1.0 if k == 0 else self.PRIOR_VERIFY + self.PRIOR_PER_DRAFT * k + k * draft
                for k in range(limit + 1)
            }
        else:
            draft = self.PRIOR_DRAFT_MODEL * plain if self.draft is None else self.draft
            cost = {k: self._round_seconds(k) + k * draft for k in range(limit + 1)}
        rate = {k: self.expected_tokens(k) / cost[k] for k in cost}
        return max(rate, key=lambda k: (rate[k], -k))

    def _decay(self) -> None:
        self.kept, self.tried = self.kept * self.DECAY, self.tried * self.DECAY

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.SMOOTH) * old + self.SMOOTH * new

    def observe(self, k: int, accepted: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """A round with ``k`` drafts (0: a plain step), ``accepted`` of them kept: the target took
        ``seconds`` (verify and rollback), drafting ``draft_seconds``."""
        self.seconds[k] = self._average(self.seconds.get(k), seconds)
        if k and not self.free and self.plain_run == 0:  # not a catch-up after plain rounds
            self.draft = self._average(self.draft, draft_seconds / k)
        self.plain_run = self.plain_run + 1 if k == 0 else 0
        if k:
            self._decay()
            self.kept += accepted
            self.tried += accepted + (accepted < k)  # drafts after the first miss were never judged

    def observe_probe(self, hit: bool) -> None:
        """A free drafter's first token, asked in a round without drafts, was (not) the target's."""
        self._decay()
        self.kept += hit
        self.tried += 1


def _stop_recording(cache) -> None:
    """After a commit nothing is left to undo: recurrent layers stop recording their inputs, so
    a round without drafts runs the target's one-token fast path (which refuses a recording cache)."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, MixerStateLayer):
            layer.record_past = False


def _check_request(
    input_ids: torch.LongTensor, num_draft_tokens, do_sample: bool, temperature: float, top_k, top_p
) -> None:
    """One prompt; at least 1 draft per round (or ``"auto"``); sampling settings that can sample."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(
            f"speculative decoding takes one prompt (input_ids of shape (1, l)), got {tuple(input_ids.shape)}",
            "run prompts one at a time",
        )
    if num_draft_tokens != AUTO and (
        isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1
    ):
        raise ConfigError(
            f"num_draft_tokens={num_draft_tokens!r}",
            "draft at least 1 token per round (2-6 is typical), or pass 'auto'",
        )
    if do_sample:
        check_sampling(temperature, top_k, top_p)
        if temperature == 0:
            raise ConfigError(
                "temperature=0 with do_sample=True",
                "sample at a positive temperature, or pass do_sample=False for greedy decoding",
            )


def _target_runner(target, input_ids: torch.LongTensor, cache) -> Runner:
    """The target's runner; given a prefilled ``cache``, one that has consumed all but the last prompt token."""
    ver = Runner(target)
    if cache is not None:
        if cache.get_seq_length() != input_ids.shape[1] - 1:
            raise ConfigError(
                f"a prefilled cache holds {cache.get_seq_length()} tokens, not the prompt's {input_ids.shape[1] - 1} (all but the last)",
                "prefill both models on input_ids[:, :-1]",
            )
        ver.cache, ver.consumed = cache, input_ids.shape[1] - 1
    return ver


def _prefill(ver: Runner, drafter: Drafter, input_ids: torch.LongTensor, caches: tuple) -> float:
    """The target (unless its cache is prefilled) and a draft model consume all but the last prompt
    token, which opens the first round; the seconds it took."""
    t0 = time.perf_counter()
    if input_ids.shape[1] > 1 and caches[0] is None:
        ver.feed(input_ids[:, :-1], keep=1)
    drafter.start(input_ids, caches[1])
    return time.perf_counter() - t0


def _verify(
    ver: Runner, text: list[int], drafts: list[int], q: list, sampling: dict | None, generator, device
) -> tuple[int, int]:
    """One target forward over [pending; drafts] scores all k drafts and one token beyond: how many
    drafts the target keeps, and its own next token."""
    k = len(drafts)
    if k:
        ver.start_round()
    pending = torch.tensor([text[ver.consumed :] + drafts], dtype=torch.long, device=device)
    v_logits = ver.feed(pending, keep=k + 1)
    d = torch.tensor(drafts, dtype=torch.long, device=v_logits.device)
    if sampling is not None:
        p = warp(v_logits, sampling["temperature"], sampling["top_k"], sampling["top_p"])
        return accept_sampled(p, torch.stack(q).to(p.device) if q else p[:0], d, generator)
    return accept_greedy(v_logits, d)


def _until_eos(emitted: list[int], eos: set) -> tuple[list[int], bool]:
    """``emitted`` up to and including its first end-of-sequence token, and whether it had one."""
    for j, t in enumerate(emitted):
        if t in eos:
            return emitted[: j + 1], True
    return emitted, False


def _forget(ver: Runner, keep: int) -> None:
    """The target forgets what it consumed past ``keep`` tokens of the text, and stops recording."""
    ver.rollback(min(ver.consumed, keep))
    _stop_recording(ver.cache)


def _draft(
    drafter: Drafter, policy: DraftLength | None, text: list[int], k: int, room: int, sampling, generator
):
    """(drafts, their draft probabilities, probe): up to ``k`` drafts after ``text``; ``probe``: with
    ``k`` = 0, a free drafter's one token for ``policy`` to test α on (else [])."""
    drafts, q = drafter.propose(text, k, sampling, generator) if k else ([], [])
    probe = (
        drafter.propose(text, 1, None, None)[0]
        if policy is not None and not k and policy.free and room > 0
        else []
    )
    return drafts, q, probe


def _round(
    ver: Runner,
    drafter: Drafter,
    policy: DraftLength | None,
    text: list[int],
    k: int,
    room: int,
    sampling: dict | None,
    generator,
    eos: set,
    stats: SpeculativeStats,
    device,
) -> tuple[list[int], bool]:
    """One round of up to ``k`` drafts: draft, verify, extend ``text`` by the emitted tokens, forget
    what the target consumed past them; the emitted tokens and whether an end of sequence came."""
    start = len(text)

    # 1. draft up to k tokens (a free drafter is asked for one even when k = 0: a probe of α)
    t0 = time.perf_counter()
    drafts, q, probe = _draft(drafter, policy, text, k, room, sampling, generator)
    k = len(drafts)
    t1 = time.perf_counter()

    # 2. verify, and emit the accepted drafts and the target's token (up to an end of sequence)
    n, token = _verify(ver, text, drafts, q, sampling, generator, device)
    stats.draft_seconds += t1 - t0
    stats.verify_seconds += time.perf_counter() - t1
    emitted, done = _until_eos(drafts[:n] + [token], eos)
    text.extend(emitted)
    stats.add_round(k, n, len(emitted))

    # 3. forget what was consumed past the accepted text: text[:start] and the accepted drafts
    #    stay, the last emitted token is fed next round
    keep = start + min(n, len(emitted) - 1)
    if k:
        t2 = time.perf_counter()
        _forget(ver, keep)
        stats.verify_seconds += time.perf_counter() - t2
    drafter.accept(keep)
    if policy is not None:
        policy.observe(k, n, time.perf_counter() - t1, t1 - t0)
        if probe:
            policy.observe_probe(probe[0] == token)
    return emitted, done


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 32,
    num_draft_tokens: int | str = 4,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    streamer=None,
    past_key_values: tuple | None = None,
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` after ``input_ids`` (1, l), ``draft`` proposing up to
    ``num_draft_tokens`` tokens per target forward (``"auto"``: chosen each round, ``DraftLength``).
    ``draft``: a model sharing the target's
    tokenizer, ``"ngram"`` / ``"ngram:N"`` (prompt lookup) or a ``Drafter``. Greedy output equals
    the target's own greedy output; sampled output follows the target's (warped) distribution.

    ``past_key_values=(target_cache, draft_cache)``: caches that already hold every prompt token
    but the last (e.g. copies of one long prefill, to compare settings from one state); the
    draft's is None for a drafter without a model."""
    _check_request(input_ids, num_draft_tokens, do_sample, temperature, top_k, top_p)
    drafter: Drafter = make_drafter(draft, target.config.get_text_config().vocab_size)
    policy = DraftLength(free=isinstance(drafter, NgramDrafter)) if num_draft_tokens == AUTO else None
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p) if do_sample else None
    stats = SpeculativeStats()
    caches = past_key_values or (None, None)
    ver = _target_runner(target, input_ids, caches[0])
    text = input_ids[0].tolist()
    device = input_ids.device
    if streamer is not None:
        streamer.put(input_ids.cpu())
    stats.prefill_seconds = _prefill(ver, drafter, input_ids, caches)

    new, done = 0, False
    while new < max_new_tokens and not done:
        room = max_new_tokens - new - 1  # leave room for the target's token
        k = policy.choose(room) if policy is not None else min(num_draft_tokens, room)
        emitted, done = _round(ver, drafter, policy, text, k, room, sampling, generator, eos, stats, device)
        new += len(emitted)
        if streamer is not None:
            streamer.put(torch.tensor(emitted))
    if streamer is not None:
        streamer.end()
    return SpeculativeOutput(torch.tensor([text], device=device), stats)
