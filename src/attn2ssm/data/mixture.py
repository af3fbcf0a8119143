"""Training and evaluation blocks from one corpus or from a weighted mixture of several.

A recipe names its text as ``data.corpus`` (one source) or ``data.sources`` (a list of
``{corpus, weight, max_tokens}``). Each source is prepared on its own, with its own cache:
tokenized (:func:`.packing.prepare_corpus`, streamed when it is a capped hub dataset) or sampled
from the teacher (``generated:``, :func:`.teacher_samples.generate_corpus`), then packed into
blocks of ``block_len`` tokens.

*One source*: its blocks in corpus order, as before mixtures existed.

*Several sources*: the trainer draws blocks by position from one tensor (``block_indices`` over
``len(blocks)``, a fresh permutation per epoch), so the mixture is materialised as one tensor of
``n`` blocks of which source ``s`` holds ``counts[s] ≈ n × weight[s] / Σ weights`` (largest
remainders, at least one each). ``n`` is the run's budget in blocks (the most blocks one LM stage
draws) when the recipe has one, else all the sources' blocks together. A source's blocks are taken
in a seeded order and repeated only once all of them were used (``block_indices`` per source), so a
source repeats only when its weight asks for more than it holds, and a large one is read only as far
as the budget goes. The sources are interleaved so that every prefix of the tensor keeps the weights
(stride scheduling), and the trainer's uniform shuffle keeps them exactly over an epoch and up to
sampling noise over any run of draws. All of it follows from the sources, weights and seed alone,
so a resumed run gets the same batches.

Token caps: a source's ``max_tokens`` if set; else its share ``weight/Σ × data.max_train_tokens``;
else, for a hub source, the tokens its ``counts[s]`` blocks need (streamed: nothing more is read).

Held-out text: each source's own held-out split (:mod:`.splits`), at most ``max_heldout_tokens`` per
source, packed into blocks; these are interleaved by weight without repetition, so the first blocks
(the trainer scores the first ``eval_batches × 4``; the report's perplexity reads the first
``eval.max_tokens`` tokens of them laid end to end) follow the weights until a source runs out.
A source with less than one held-out block adds none.

Memory: by default the blocks are int64 tensors (8 bytes a token) and a mixture is one materialised
copy of every drawn block. ``compact=True`` keeps the same blocks in the same order as
:class:`TokenBlocks`: each source's stream at its narrowest width (2 bytes a token for a vocabulary of
at most 65,536 ids; shard folders are read at that width straight from their files) and a mixture as
a ``(source, row)`` index of 16 bytes a block, widened to int64 only for the batch drawn.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from attn2ssm.errors import DataError

from .packing import TokenizedCorpus, block_indices, pack_blocks, prepare_corpus
from .shards import compact_dtype, is_shards, read_shards
from .specs import DEFAULT_TEXT_FIELD, can_stream, is_chat, is_generated
from .teacher_samples import build_chat_corpus, generate_corpus


class TokenBlocks:
    """Training (or held-out) blocks kept compact: each source's ids at their narrowest width
    (``torch.uint16`` for a vocabulary of at most 65,536 ids, else ``torch.int32``) as
    ``(n_s, block_len)`` views of its stream, and a mixture as ``(source, row)`` per block into them,
    never one materialised copy (a source drawn twice costs its index, not its tokens).

    It stands in for the ``(n, block_len)`` int64 tensor of the default form wherever the trainer
    reads blocks: ``len(blocks)``, ``blocks.shape``, and indexing by an int, a slice, an index tensor
    or a boolean mask return int64 ids (on the CPU; the caller moves them), so only the drawn batch is
    ever widened. ``tensor()`` materialises all of it (tests, small data)."""

    def __init__(
        self, parts: list[torch.Tensor], source: torch.Tensor | None = None, row: torch.Tensor | None = None
    ):
        if source is None and len(parts) != 1:
            raise ValueError("several parts need source and row indices")
        self.parts, self.source, self.row = parts, source, row
        self.block_len = parts[0].shape[1]

    def __len__(self) -> int:
        return len(self.parts[0]) if self.source is None else len(self.source)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), self.block_len))

    @property
    def dtype(self) -> torch.dtype:
        return torch.long  # what indexing gives

    @property
    def nbytes(self) -> int:
        """Memory held: the sources' ids and the mixture's index."""
        index = (
            0
            if self.source is None
            else self.source.numel() * self.source.element_size() + self.row.numel() * self.row.element_size()
        )
        return sum(p.numel() * p.element_size() for p in self.parts) + index

    def __getitem__(self, idx) -> torch.Tensor:
        if self.source is None:
            return self.parts[0][idx].long()
        source, row = self.source[idx], self.row[idx]
        if source.dim() == 0:
            return self.parts[int(source)][int(row)].long()
        out = torch.empty((len(source), self.block_len), dtype=torch.long)
        for s in source.unique().tolist():
            pick = source == s
            out[pick] = self.parts[s][row[pick]].long()
        return out

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def tensor(self) -> torch.Tensor:
        """All blocks as one ``(n, block_len)`` int64 tensor."""
        return self[:]


@dataclass
class TrainingData:
    """What the trainer trains and evaluates on (see the module docstring)."""

    blocks: torch.Tensor | TokenBlocks  # (n, block_len) training blocks, drawn by position
    eval_blocks: torch.Tensor | TokenBlocks  # (m, block_len) held-out blocks, in evaluation order
    corpus: TokenizedCorpus  # heldout_ids: the held-out stream the report scores
    source_of: torch.Tensor  # (n,) index into ``sources`` of each training block
    eval_source_of: torch.Tensor  # (m,)
    sources: list[dict] = field(default_factory=list)  # per source: spec, share, blocks, draws, caps, cache

    def describe(self) -> str:
        """One line per source: its share of the blocks and how often its text repeats."""
        lines = [
            f"data: {len(self.blocks)} training blocks, {len(self.eval_blocks)} held-out blocks of {self.blocks.shape[1]} tokens"
        ]
        for s in self.sources:
            cached = " (cached)" if s["from_cache"] else ""
            lines.append(
                f"  {s['spec']}: {s['share']:.1%} of blocks, {s['draws']} drawn from {s['blocks']} "
                f"(×{s['draws'] / s['blocks']:.2f}), {s['heldout_blocks']} held out{cached}"
            )
        return "\n".join(lines)


def load_training_data(
    sources,
    tokenizer,
    block_len: int,
    *,
    seed: int = 0,
    max_train_tokens: int | None = None,
    max_heldout_tokens: int | None = None,
    text_field: str | None = None,
    budget_blocks: int | None = None,
    teacher=None,
    progress: bool = True,
    compact: bool = False,
) -> TrainingData:
    """Prepare every source and build the training and held-out blocks.

    ``sources`` are objects with ``corpus``, ``weight`` and ``max_tokens`` (the recipe's
    ``SourceConfig``); ``budget_blocks`` is the most blocks one stage will draw (None: unknown);
    ``teacher`` is needed for ``generated:`` sources. Raises :class:`DataError`.

    ``compact=True`` keeps the same blocks, in the same order, as :class:`TokenBlocks` (2 bytes a
    token for a vocabulary of at most 65,536 ids, 4 above, instead of 8, and a mixture as an index
    instead of a copy); shard folders are read at their files' width, other sources narrowed once
    prepared. ``corpus.heldout_ids`` stays int64 (the report scores it), and ``corpus.train_ids`` is
    then empty: the training ids live in ``blocks`` only.
    """
    sources = list(sources)
    if not sources:
        raise DataError("no data sources given", "set data.corpus, or list data.sources")
    weights = [float(s.weight) for s in sources]
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise DataError(
            f"source weights must be positive numbers, got {weights}",
            "give every data.sources entry a weight > 0",
        )
    shares = [w / sum(weights) for w in weights]
    # a spec's own ?field= then works
    field_ = None if text_field in (None, DEFAULT_TEXT_FIELD) else text_field

    def prepare(i: int, cap: int | None) -> TokenizedCorpus:
        return _prepare_source(
            sources[i].corpus,
            tokenizer,
            cap,
            max_heldout_tokens,
            text_field=field_,
            seed=seed,
            teacher=teacher,
            progress=progress,
            compact=compact,
        )

    if len(sources) == 1:
        cap = _cap(sources[0], 1.0, max_train_tokens, budget_blocks, block_len)
        return _one_source(sources[0], prepare(0, cap), cap, block_len, compact)
    return _mixture(sources, shares, prepare, block_len, seed, max_train_tokens, budget_blocks, compact)


def _prepare_source(
    spec: str,
    tokenizer,
    cap: int | None,
    max_heldout_tokens: int | None,
    *,
    text_field: str | None,
    seed: int,
    teacher,
    progress: bool,
    compact: bool,
) -> TokenizedCorpus:
    """One source's training and held-out ids, ``cap`` training tokens at most (None: all of it)."""
    if is_shards(spec):  # ids written once (data/shards.py): nothing to tokenize
        return read_shards(
            spec, tokenizer, max_train_tokens=cap, max_heldout_tokens=max_heldout_tokens, compact=compact
        )
    if is_generated(spec):
        corpus = _generated(spec, tokenizer, teacher, seed, cap, max_heldout_tokens, progress)
    elif is_chat(spec):  # the teacher's answers, sampled once, then a local .jsonl corpus
        if teacher is None:
            raise DataError(
                f"{spec!r} is answered by the teacher, and none was given",
                "pass teacher= (the trainer does)",
            )
        path = build_chat_corpus(spec, teacher, tokenizer, seed=seed, progress=progress)
        corpus = prepare_corpus(
            str(path), tokenizer, max_train_tokens=cap, max_heldout_tokens=max_heldout_tokens
        )
    else:
        corpus = prepare_corpus(
            spec,
            tokenizer,
            max_train_tokens=cap,
            max_heldout_tokens=max_heldout_tokens,
            text_field=text_field,
        )
    if compact:
        narrow = compact_dtype(len(tokenizer))
        corpus = TokenizedCorpus(
            corpus.train_ids.to(narrow),
            corpus.heldout_ids.to(narrow),
            corpus.tokenizer_fingerprint,
            corpus.meta,
        )
    return corpus


def _one_source(
    source, corpus: TokenizedCorpus, cap: int | None, block_len: int, compact: bool
) -> TrainingData:
    """A single source's blocks, in corpus order."""
    blocks, eval_blocks = (
        pack_blocks(corpus.train_ids, block_len),
        pack_blocks(corpus.heldout_ids, block_len, heldout=True),
    )
    info = _info(source, 1.0, corpus, len(blocks), len(blocks), len(eval_blocks), cap)
    # all from source 0
    only = (
        torch.zeros(len(blocks), dtype=torch.long),
        torch.zeros(len(eval_blocks), dtype=torch.long),
    )
    if compact:
        blocks, eval_blocks = TokenBlocks([blocks]), TokenBlocks([eval_blocks])
        corpus = TokenizedCorpus(
            _NO_IDS,
            corpus.heldout_ids.long(),
            corpus.tokenizer_fingerprint,
            {**corpus.meta, "compact": True},
        )
    return TrainingData(blocks, eval_blocks, corpus, *only, [info])


def _mixture(
    sources: list,
    shares: list[float],
    prepare,
    block_len: int,
    seed: int,
    max_train_tokens: int | None,
    budget_blocks: int | None,
    compact: bool,
) -> TrainingData:
    """Several sources' blocks, interleaved by weight (see the module docstring);
    ``prepare(i, cap)`` prepares source ``i``."""
    counts = apportion(shares, budget_blocks) if budget_blocks else None
    caps = [
        _cap(s, shares[i], max_train_tokens, counts[i] if counts else None, block_len)
        for i, s in enumerate(sources)
    ]
    corpora = [prepare(i, cap) for i, cap in enumerate(caps)]
    parts = []
    for s, corpus in zip(sources, corpora):
        if corpus.train_ids.numel() < block_len:
            raise DataError(
                f"source {s.corpus!r} has {corpus.train_ids.numel()} training tokens, fewer than one block of {block_len}",
                "raise its max_tokens, add text, or lower data.block_len",
            )
        parts.append(pack_blocks(corpus.train_ids, block_len))
    if counts is None:
        counts = apportion(shares, sum(len(p) for p in parts))
    if compact:  # an index into the sources' blocks, not a copy of them
        source_of, row = mix_rows([len(p) for p in parts], counts, seed)
        blocks = TokenBlocks(parts, source_of, row)
    else:
        blocks, source_of = mix_blocks(parts, counts, seed)
    held, src, pos = _heldout_blocks(corpora, shares, block_len)
    infos = [
        _info(s, shares[i], c, len(parts[i]), counts[i], len(held[i]), caps[i])
        for i, (s, c) in enumerate(zip(sources, corpora))
    ]
    meta = {"spec": " + ".join(f"{i['share']:.3g}×{i['spec']}" for i in infos), "sources": infos}
    if compact:
        eval_blocks = TokenBlocks(held, src, pos)
        corpus = TokenizedCorpus(
            _NO_IDS,
            eval_blocks.tensor().reshape(-1),
            corpora[0].tokenizer_fingerprint,
            {**meta, "compact": True},
        )
    else:
        eval_blocks = torch.stack([held[s][p] for s, p in zip(src.tolist(), pos.tolist())])
        corpus = TokenizedCorpus(
            blocks.reshape(-1), eval_blocks.reshape(-1), corpora[0].tokenizer_fingerprint, meta
        )
    return TrainingData(blocks, eval_blocks, corpus, source_of, src, infos)


def _heldout_blocks(corpora: list[TokenizedCorpus], shares: list[float], block_len: int):
    """Each source's held-out blocks and their order, interleaved by share without repetition:
    ``(held, source, index within source)``."""
    held = [
        c.heldout_ids[: c.heldout_ids.numel() // block_len * block_len].view(-1, block_len) for c in corpora
    ]
    src, pos = interleave([len(h) for h in held], shares)
    if not len(src):
        raise DataError(
            f"no source has {block_len} held-out tokens for one evaluation block",
            "raise data.max_heldout_tokens, add a source with more documents, or lower data.block_len",
        )
    return held, src, pos


_NO_IDS = torch.zeros(0, dtype=torch.long)  # compact: the training ids live in the blocks only


# ----------------------------------------------------------------------------------- mixing


def apportion(shares: list[float], n: int) -> list[int]:
    """``n`` split in proportion to ``shares`` (largest remainders, ties to the earlier source);
    every source gets at least one when ``n`` allows it."""
    raw = [s * n for s in shares]
    counts = [math.floor(r) for r in raw]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    for i in range(len(counts)):
        if counts[i] == 0 and n >= len(counts):
            counts[max(range(len(counts)), key=lambda j: counts[j])] -= 1
            counts[i] = 1
    return counts


def interleave(counts: list[int], rates: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """An order of ``counts[s]`` items per source in which source ``s`` comes up at rate ``rates[s]``
    (stride scheduling: item ``k`` of source ``s`` sits at time ``(k + ½) / rates[s]``; ties go to the
    earlier source). Returns ``(source, index within source)`` per position."""
    keys = (
        torch.cat([(torch.arange(c, dtype=torch.float64) + 0.5) / r for c, r in zip(counts, rates)])
        if counts
        else torch.zeros(0)
    )
    source = (
        torch.cat([torch.full((c,), s, dtype=torch.long) for s, c in enumerate(counts)])
        if counts
        else torch.zeros(0, dtype=torch.long)
    )
    index = torch.cat([torch.arange(c) for c in counts]) if counts else torch.zeros(0, dtype=torch.long)
    order = torch.argsort(keys, stable=True)
    return source[order], index[order]


def mix_blocks(parts: list[torch.Tensor], counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts[s]`` blocks of each ``parts[s]`` (``(n_s, block_len)``) in one interleaved tensor.

    Source ``s`` gives its blocks in the order ``block_indices(n_s, seed_s, 0, counts[s])``: a seeded
    permutation, repeated with a fresh one only when exhausted. Returns ``(blocks, source_of)``.
    """
    source, row = mix_rows([len(p) for p in parts], counts, seed)
    out = torch.empty((len(source), parts[0].shape[1]), dtype=parts[0].dtype)
    for s, part in enumerate(parts):
        pick = source == s
        if pick.any():
            out[pick] = part[row[pick]]
    return out, source


def mix_rows(n_blocks: list[int], counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which block of which source each position of :func:`mix_blocks`' tensor holds, for sources of
    ``n_blocks[s]`` blocks: ``(source, row)`` (the index a :class:`TokenBlocks` keeps instead of the copy)."""
    source, index = interleave(counts, [float(c) for c in counts])
    row = torch.zeros_like(index)
    for s, (n, count) in enumerate(zip(n_blocks, counts)):
        if not count:
            continue
        picks = block_indices(n, _source_seed(seed, s), 0, count)
        pick = source == s
        row[pick] = picks[index[pick]]
    return source, row


def _source_seed(seed: int, s: int) -> int:
    digest = hashlib.sha256(f"attn2ssm-mixture:{seed}:{s}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# ---------------------------------------------------------------------------------- sources


def _cap(
    source, share: float, max_train_tokens: int | None, budget_blocks: int | None, block_len: int
) -> int | None:
    """Training tokens to prepare for ``source`` (see the module docstring); None: all of it.
    ``budget_blocks`` is how many blocks the mixture draws from this source (None: unknown)."""
    if source.max_tokens is not None:
        return int(source.max_tokens)
    if max_train_tokens is not None:
        return math.floor(share * max_train_tokens)
    if budget_blocks and not is_generated(source.corpus) and can_stream(source.corpus):
        return budget_blocks * block_len  # budget_blocks: this source's own count of blocks
    return None


def _generated(
    spec: str, tokenizer, teacher, seed: int, cap: int | None, max_heldout: int | None, progress: bool
) -> TokenizedCorpus:
    if teacher is None:
        raise DataError(
            f"{spec!r} is sampled from the teacher, and none was given", "pass teacher= (the trainer does)"
        )
    corpus = generate_corpus(spec, teacher, tokenizer, seed=seed, progress=progress)
    if cap is not None or max_heldout is not None:  # the same caps as a tokenized corpus
        corpus = TokenizedCorpus(
            corpus.train_ids[:cap],
            corpus.heldout_ids[:max_heldout],
            corpus.tokenizer_fingerprint,
            corpus.meta,
        )
    return corpus


def _info(
    source,
    share: float,
    corpus: TokenizedCorpus,
    n_blocks: int,
    draws: int,
    heldout_blocks: int,
    cap: int | None,
) -> dict:
    return {
        "spec": source.corpus,
        "weight": float(source.weight),
        "share": share,
        "blocks": n_blocks,
        "draws": draws,
        "heldout_blocks": heldout_blocks,
        "max_tokens": cap,
        "from_cache": bool(corpus.meta.get("from_cache")),
        "streamed": bool(corpus.meta.get("streamed")),
    }
