"""Documents → one token stream per side → fixed-length blocks.

Distillation trains on blocks of ``block_len`` consecutive tokens cut from a single stream in
which documents are joined by the tokenizer's EOS token, so no padding is ever needed and the
teacher sees the same document boundaries it saw in pretraining. Tokenizing is the slow step,
so the streams are cached under ``cache_dir()/tokenized/`` keyed by everything that changes
them (corpus and its files, text field, tokenizer vocabulary, token limits), and a cache file is
refused when it was made with another tokenizer.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import torch

from attn2ssm.errors import DataError
from attn2ssm.paths import atomic_write_bytes, cache_dir

from .shards import read_shards
from .sources import corpus_stamp, load_documents
from .specs import can_stream, is_shards, parse_spec
from .splits import split_documents
from .tokenize import TokenizedCorpus, eos_id, tokenize_documents, tokenize_stream, tokenizer_fingerprint

FORMAT_VERSION = 1


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
    if is_shards(spec):
        return read_shards(
            spec, tokenizer, max_train_tokens=max_train_tokens, max_heldout_tokens=max_heldout_tokens
        )
    base, text_field = parse_spec(spec, text_field)
    stream = max_train_tokens is not None and can_stream(base)
    fingerprint = tokenizer_fingerprint(tokenizer)
    path = _cache_path(base, text_field, fingerprint, max_train_tokens, max_heldout_tokens, stream)
    if cache and path.is_file():
        try:
            corpus = _load(path, fingerprint)
        except DataError:
            pass  # unreadable (e.g. a disk filled up mid-write elsewhere): rebuild it
        else:
            corpus.meta.update(from_cache=True, cache_path=str(path))
            return corpus

    corpus = _tokenize(base, text_field, tokenizer, fingerprint, max_train_tokens, max_heldout_tokens, stream)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tokenized(corpus, path)
    corpus.meta.update(from_cache=False, cache_path=str(path) if cache else None)
    return corpus


def _tokenize(
    base: str,
    text_field: str | None,
    tokenizer,
    fingerprint: str,
    max_train: int | None,
    max_heldout: int | None,
    stream: bool,
) -> TokenizedCorpus:
    """Tokenize ``base`` afresh (streamed, or split after loading it whole) into the two streams,
    with the meta that records how."""
    eos = eos_id(tokenizer)
    tokenize = tokenize_stream if stream else _tokenize_split
    train_ids, heldout_ids, counts = tokenize(base, text_field, tokenizer, eos, max_train, max_heldout)
    meta = {
        "spec": base,
        "text_field": text_field,
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token_id": eos,
        **counts,
        "n_train_tokens": int(train_ids.numel()),
        "n_heldout_tokens": int(heldout_ids.numel()),
        "max_train_tokens": max_train,
        "max_heldout_tokens": max_heldout,
    }
    return TokenizedCorpus(train_ids, heldout_ids, fingerprint, meta)


def _cache_path(
    base: str, text_field: str, fingerprint: str, max_train: int | None, max_heldout: int | None, stream: bool
) -> Path:
    """Where the tokenized corpus is cached: keyed by everything that changes its ids."""
    key_fields = {
        "format": FORMAT_VERSION,
        "spec": base,
        "stamp": corpus_stamp(base),
        "text_field": text_field,
        "tokenizer": fingerprint,
        "max_train_tokens": max_train,
        "max_heldout_tokens": max_heldout,
    }
    if stream:  # a streamed corpus stops reading early; keep its cache apart from a downloaded one
        key_fields["stream"] = True
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "tokenized" / f"{key}.pt"


def _tokenize_split(
    base: str, text_field: str, tokenizer, eos: int, max_train: int | None, max_heldout: int | None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A read (not streamed) corpus: its documents loaded, split by hash and tokenized in order."""
    train_docs, heldout_docs = split_documents(load_documents(base, text_field=text_field), base)
    train_ids = tokenize_documents(train_docs, tokenizer, eos, max_train, "train")
    heldout_ids = tokenize_documents(heldout_docs, tokenizer, eos, max_heldout, "held-out")
    return train_ids, heldout_ids, {"n_train_docs": len(train_docs), "n_heldout_docs": len(heldout_docs)}


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
