"""Documents → one token stream per side → fixed-length blocks.

Distillation trains on blocks of ``block_len`` consecutive tokens cut from a single stream in
which documents are joined by the tokenizer's EOS token, so no padding is ever needed and the
teacher sees the same document boundaries it saw in pretraining. Tokenizing is the slow step,
so the streams are cached under ``cache_dir()/tokenized/`` keyed by everything that changes
them (corpus and its files, text field, tokenizer vocabulary, token limits), and a cache file is
refused when it was made with another tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
from array import array
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attn2ssm.errors import DataError
from attn2ssm.paths import atomic_write_bytes, cache_dir

from .sources import (
    Document,
    can_stream,
    corpus_stamp,
    iter_hf_documents,
    load_documents,
    parse_spec,
)
from .splits import is_heldout_id, split_documents

FORMAT_VERSION = 1
_BATCH_DOCS = 64
_PROGRESS_MIN_DOCS = 100
_LONG_SEQ_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


@dataclass
class TokenizedCorpus:
    """Token streams of a corpus' train and held-out documents (1-D ``torch.long``)."""

    train_ids: torch.Tensor
    heldout_ids: torch.Tensor
    tokenizer_fingerprint: str
    meta: dict = field(default_factory=dict)


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable 16-hex-digit hash of the tokenizer's class, vocabulary and EOS id.

    Token ids mean nothing without the vocabulary that produced them. The ``(token, id)``
    pairs are hashed in id order (dict order is not canonical); about 0.1 s for 50k tokens.
    """
    items = sorted(tokenizer.get_vocab().items(), key=itemgetter(1))
    h = hashlib.sha256(f"{type(tokenizer).__name__}|eos={tokenizer.eos_token_id}|".encode())
    h.update("\x00".join([token for token, _ in items]).encode("utf-8", "surrogatepass"))
    h.update(array("q", [i for _, i in items]).tobytes())
    return h.hexdigest()[:16]


def prepare_corpus(
    spec: str,
    tokenizer,
    *,
    max_train_tokens: int | None = None,
    max_heldout_tokens: int | None = None,
    cache: bool = True,
    text_field: str | None = None,
) -> TokenizedCorpus:
    """Load, split and tokenize ``spec`` (see :mod:`.sources`), reusing the on-disk cache.

    ``max_*_tokens`` cut each stream to at most that many tokens (documents are taken in
    corpus order, and tokenizing stops once the limit is reached). ``meta["from_cache"]``
    tells whether the cache answered. A hub corpus with ``max_train_tokens`` set is streamed
    (:func:`.sources.iter_hf_documents`): rows are read only until both streams are full (the
    held-out one when ``max_heldout_tokens`` is set), with the split a full download would give.
    A ``shards:DIR`` spec reads token ids written once (:mod:`.shards`): nothing to tokenize.
    """
    from .shards import is_shards, read_shards  # shards.py imports this module

    if is_shards(spec):
        return read_shards(
            spec, tokenizer, max_train_tokens=max_train_tokens, max_heldout_tokens=max_heldout_tokens
        )
    base, text_field = parse_spec(spec, text_field)
    stream = max_train_tokens is not None and can_stream(base)
    fingerprint = tokenizer_fingerprint(tokenizer)
    key_fields = {
        "format": FORMAT_VERSION,
        "spec": base,
        "stamp": corpus_stamp(base),
        "text_field": text_field,
        "tokenizer": fingerprint,
        "max_train_tokens": max_train_tokens,
        "max_heldout_tokens": max_heldout_tokens,
    }
    if stream:  # a streamed corpus stops reading early; keep its cache apart from a downloaded one
        key_fields["stream"] = True
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir() / "tokenized" / f"{key}.pt"
    if cache and path.is_file():
        try:
            corpus = _load(path, fingerprint)
        except DataError:
            pass  # unreadable (e.g. a disk filled up mid-write elsewhere): rebuild it
        else:
            corpus.meta.update(from_cache=True, cache_path=str(path))
            return corpus

    eos = _eos_id(tokenizer)
    if stream:
        train_ids, heldout_ids, counts = _tokenize_stream(
            base, text_field, tokenizer, eos, max_train_tokens, max_heldout_tokens
        )
    else:
        train_docs, heldout_docs = split_documents(load_documents(base, text_field=text_field), base)
        train_ids = _tokenize(train_docs, tokenizer, eos, max_train_tokens, "train")
        heldout_ids = _tokenize(heldout_docs, tokenizer, eos, max_heldout_tokens, "held-out")
        counts = {"n_train_docs": len(train_docs), "n_heldout_docs": len(heldout_docs)}
    meta = {
        "spec": base,
        "text_field": text_field,
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token_id": eos,
        **counts,
        "n_train_tokens": int(train_ids.numel()),
        "n_heldout_tokens": int(heldout_ids.numel()),
        "max_train_tokens": max_train_tokens,
        "max_heldout_tokens": max_heldout_tokens,
    }
    corpus = TokenizedCorpus(train_ids, heldout_ids, fingerprint, meta)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tokenized(corpus, path)
    corpus.meta.update(from_cache=False, cache_path=str(path) if cache else None)
    return corpus


def save_tokenized(corpus: TokenizedCorpus, path: Path) -> None:
    """Write ``corpus`` atomically; ids are stored as int32 to halve the file."""
    payload = {
        "format": FORMAT_VERSION,
        "train_ids": corpus.train_ids.to(torch.int32),
        "heldout_ids": corpus.heldout_ids.to(torch.int32),
        "tokenizer_fingerprint": corpus.tokenizer_fingerprint,
        "meta": {k: v for k, v in corpus.meta.items() if k not in ("from_cache", "cache_path")},
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def load_tokenized(path, tokenizer) -> TokenizedCorpus:
    """Read a cached corpus, refusing one whose token ids came from a different tokenizer."""
    return _load(Path(path), tokenizer_fingerprint(tokenizer))


def _load(path: Path, expected: str) -> TokenizedCorpus:
    if not path.is_file():
        raise DataError(f"tokenized corpus {str(path)!r} does not exist", "run prepare again to create it")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        fingerprint = payload["tokenizer_fingerprint"]
        train, heldout = payload["train_ids"], payload["heldout_ids"]
    except Exception as e:
        raise DataError(
            f"tokenized corpus {str(path)!r} is unreadable ({e})",
            f"delete {path} and run prepare again",
        ) from e
    if payload.get("format") != FORMAT_VERSION:
        raise DataError(
            f"tokenized corpus {str(path)!r} has an old format",
            f"delete {path} and run prepare again",
        )
    if fingerprint != expected:
        raise DataError(
            f"corpus {str(path)!r} was tokenized with another tokenizer "
            f"(fingerprint {fingerprint}, this one is {expected})",
            f"re-run prepare with this tokenizer, or delete the cache file {path}",
        )
    return TokenizedCorpus(train.long(), heldout.long(), fingerprint, dict(payload.get("meta") or {}))


def _eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} has no EOS token to separate documents",
            "set tokenizer.eos_token (e.g. to its end-of-text token) before preparing data",
        )
    return int(eos)


class _Joiner:
    """Token ids of documents joined by ``eos`` into one stream, cut to at most ``limit`` tokens."""

    def __init__(self, eos: int, limit: int | None, label: str):
        if limit is not None and limit < 0:
            raise DataError(
                f"token limit for {label} data is negative ({limit})",
                "use a positive number or leave it unset",
            )
        self.sep, self.limit = torch.tensor([eos], dtype=torch.int32), limit
        self.pieces: list[torch.Tensor] = []
        self.total = 0
        self.docs = 0  # documents taken (tokenized and added)

    @property
    def full(self) -> bool:
        return self.limit is not None and self.total >= self.limit

    def add(self, ids: list[int]) -> None:
        if self.pieces:
            self.pieces.append(self.sep)
        self.pieces.append(torch.tensor(ids, dtype=torch.int32))
        self.total += len(ids) + (len(self.pieces) > 1)
        self.docs += 1

    def ids(self) -> torch.Tensor:
        ids = torch.cat(self.pieces) if self.pieces else torch.zeros(0, dtype=torch.int32)
        return (ids if self.limit is None else ids[: self.limit]).long()


@contextlib.contextmanager
def _long_documents_allowed(tokenizer):
    """Silence the tokenizer's warning about sequences longer than the model: whole documents are, on purpose."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    was_silenced = warned.get(_LONG_SEQ_WARNING, False) if isinstance(warned, dict) else None
    if isinstance(warned, dict):
        warned[_LONG_SEQ_WARNING] = True
    try:
        yield
    finally:
        if isinstance(warned, dict):
            warned[_LONG_SEQ_WARNING] = was_silenced


def _tokenize(docs: list[Document], tokenizer, eos: int, limit: int | None, label: str) -> torch.Tensor:
    """Ids of ``docs`` joined by ``eos``, no special tokens per document, at most ``limit``."""
    out = _Joiner(eos, limit, label)
    tokenize_into(out, docs, tokenizer, label)
    return out.ids()


def tokenize_into(out: _Joiner, docs: list[Document], tokenizer, label: str) -> None:
    """Tokenize ``docs`` in order into ``out`` (a ``_Joiner``, or a shard side that writes as it
    goes), batch by batch, until it is full."""
    with (
        _long_documents_allowed(tokenizer),
        tqdm(
            total=len(docs),
            desc=f"tokenizing {label}",
            unit="doc",
            disable=len(docs) < _PROGRESS_MIN_DOCS,
        ) as bar,
    ):
        for start in range(0, len(docs), _BATCH_DOCS):
            if out.full:
                break
            batch = docs[start : start + _BATCH_DOCS]
            for ids in tokenizer([d.text for d in batch], add_special_tokens=False)["input_ids"]:
                out.add(ids)
            bar.update(len(batch))


def _tokenize_stream(
    spec: str, text_field: str, tokenizer, eos: int, train_limit: int, heldout_limit: int | None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Both streams of a streamed hub corpus (:func:`stream_into`)."""
    train = _Joiner(eos, train_limit, "train")
    held = _Joiner(eos, heldout_limit, "held-out")
    counts = stream_into(train, held, spec, text_field, tokenizer)
    return train.ids(), held.ids(), counts


def stream_into(train: _Joiner, held: _Joiner, spec: str, text_field: str, tokenizer) -> dict:
    """Stream hub corpus ``spec`` into ``train`` and ``held`` (joiners with their limits). Each row goes
    to its side of the hash split; reading stops once the training side is full and the held-out side
    too (when it has no limit, as soon as the training side is full; when neither has one, at the end
    of the split). The tokens a full download gives when both fill. Returns the counts for ``meta``."""
    rows = 0
    docs = iter_hf_documents(spec, text_field=text_field)
    goal = None if train.limit is None else train.limit + (held.limit or 0)
    with _long_documents_allowed(tokenizer), tqdm(desc=f"streaming {spec}", unit="tok", total=goal) as bar:
        while not (train.full and (held.full or held.limit is None)):
            batch = list(itertools.islice(docs, _BATCH_DOCS))
            if not batch:
                break
            rows = batch[-1].meta["row"] + 1
            wanted = [(d, held if is_heldout_id(d.id) else train) for d in batch]
            wanted = [(d, side) for d, side in wanted if not side.full]
            encoded = (
                tokenizer([d.text for d, _ in wanted], add_special_tokens=False)["input_ids"]
                if wanted
                else []
            )
            for (_, side), ids in zip(wanted, encoded):
                if not side.full:  # a batch may fill its side part-way
                    side.add(ids)
            done = (
                train.total + held.total
                if goal is None
                else min(train.total, train.limit) + min(held.total, held.limit or 0)
            )
            bar.update(done - bar.n)
    return {"n_train_docs": train.docs, "n_heldout_docs": held.docs, "streamed": True, "rows_read": rows}


def check_block_len(block_len: int, max_positions: int | None) -> None:
    """Refuse blocks longer than the teacher can attend over (``None`` = no limit)."""
    if not isinstance(block_len, int) or block_len < 1:
        raise DataError(
            f"block length must be a positive integer, not {block_len!r}",
            "set data.block_len to e.g. 1024",
        )
    if max_positions is not None and block_len > max_positions:
        raise DataError(
            f"block length {block_len} exceeds the model's maximum of {max_positions} positions",
            "lower data.block_len",
        )


def pack_blocks(ids: torch.Tensor, block_len: int, heldout: bool = False) -> torch.Tensor:
    """View a 1-D stream as ``(n_blocks, block_len)``; the incomplete tail is dropped.

    The result shares memory with ``ids``. ``heldout``: the stream is a held-out side (the error
    for too few tokens says so).
    """
    check_block_len(block_len, None)
    if ids.dim() != 1:
        raise DataError(
            f"token stream must be 1-D, got shape {tuple(ids.shape)}",
            "pass corpus.train_ids or heldout_ids",
        )
    n_blocks = ids.numel() // block_len
    if n_blocks == 0 and heldout:
        raise DataError(
            f"only {ids.numel()} held-out tokens, fewer than one evaluation block of {block_len}",
            "use a corpus with held-out text (token shards: write them with --heldout-tokens), "
            "raise data.max_heldout_tokens, or lower data.block_len",
        )
    if n_blocks == 0:
        raise DataError(
            f"only {ids.numel()} tokens, fewer than one block of {block_len}",
            "lower data.block_len or add more text",
        )
    return ids[: n_blocks * block_len].view(n_blocks, block_len)


def block_order(n_blocks: int, seed: int, epoch: int) -> torch.Tensor:
    """The order (a LongTensor permutation) in which epoch ``epoch`` visits ``n_blocks`` blocks.

    It depends only on ``(n_blocks, seed, epoch)`` — not on global RNG state — so a trainer that
    has consumed ``p`` blocks resumes exactly with ``epoch, offset = divmod(p, n_blocks)`` and
    ``block_order(n_blocks, seed, epoch)[offset:]``; :func:`block_indices` does this for you.
    """
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    digest = hashlib.sha256(f"attn2ssm-blocks:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
    return torch.randperm(n_blocks, generator=gen)


def block_indices(n_blocks: int, seed: int, start: int, count: int) -> torch.Tensor:
    """Block indices at positions ``start .. start+count-1`` of the endless stream of epochs.

    Batch ``b`` of size ``B`` is ``block_indices(n, seed, b * B, B)``, on any run and any resume.
    """
    if n_blocks < 1:
        raise DataError("no blocks to sample from", "add more text or lower data.block_len")
    out, pos = [], start
    while pos < start + count:
        epoch, offset = divmod(pos, n_blocks)
        take = min(n_blocks - offset, start + count - pos)
        out.append(block_order(n_blocks, seed, epoch)[offset : offset + take])
        pos += take
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
