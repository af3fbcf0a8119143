"""Tokenizing documents: their ids joined by the tokenizer's EOS into one stream per side, cut to a
token limit (``Joiner``), batch by batch from a list of documents (``tokenize_into``) or row by row
from a streamed hub corpus (``stream_into``); the result type (``TokenizedCorpus``) and the
tokenizer's fingerprint that travels with every id (caches, shards). :mod:`.packing` caches these
streams and cuts them into blocks; :mod:`.shard_writer` writes them to token shards as they come."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from array import array
from dataclasses import dataclass, field
from operator import itemgetter

import torch
from tqdm.auto import tqdm

from attn2ssm.errors import DataError

from .document import Document
from .sources import iter_hf_documents
from .splits import is_heldout_id

_BATCH_DOCS = 64
_PROGRESS_MIN_DOCS = 100
LONG_SEQ_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


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


def eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} has no EOS token to separate documents",
            "set tokenizer.eos_token (e.g. to its end-of-text token) before preparing data",
        )
    return int(eos)


class Joiner:
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
def long_documents_allowed(tokenizer):
    """Silence the tokenizer's warning about sequences longer than the model: whole documents are, on purpose."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    was_silenced = warned.get(LONG_SEQ_WARNING, False) if isinstance(warned, dict) else None
    if isinstance(warned, dict):
        warned[LONG_SEQ_WARNING] = True
    try:
        yield
    finally:
        if isinstance(warned, dict):
            warned[LONG_SEQ_WARNING] = was_silenced


def tokenize_documents(
    docs: list[Document], tokenizer, eos: int, limit: int | None, label: str
) -> torch.Tensor:
    """Ids of ``docs`` joined by ``eos``, no special tokens per document, at most ``limit``."""
    out = Joiner(eos, limit, label)
    tokenize_into(out, docs, tokenizer, label)
    return out.ids()


def tokenize_into(out: Joiner, docs: list[Document], tokenizer, label: str) -> None:
    """Tokenize ``docs`` in order into ``out`` (a ``Joiner``, or a shard side that writes as it
    goes), batch by batch, until it is full."""
    with (
        long_documents_allowed(tokenizer),
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


def tokenize_stream(
    spec: str, text_field: str, tokenizer, eos: int, train_limit: int, heldout_limit: int | None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Both streams of a streamed hub corpus (:func:`stream_into`)."""
    train = Joiner(eos, train_limit, "train")
    held = Joiner(eos, heldout_limit, "held-out")
    counts = stream_into(train, held, spec, text_field, tokenizer)
    return train.ids(), held.ids(), counts


def stream_into(train: Joiner, held: Joiner, spec: str, text_field: str, tokenizer) -> dict:
    """Stream hub corpus ``spec`` into ``train`` and ``held`` (joiners with their limits). Each row goes
    to its side of the hash split; reading stops once the training side is full and the held-out side
    too (when it has no limit, as soon as the training side is full; when neither has one, at the end
    of the split). The tokens a full download gives when both fill. Returns the counts for ``meta``."""
    rows = 0
    docs = iter_hf_documents(spec, text_field=text_field)
    goal = None if train.limit is None else train.limit + (held.limit or 0)
    with long_documents_allowed(tokenizer), tqdm(desc=f"streaming {spec}", unit="tok", total=goal) as bar:
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
