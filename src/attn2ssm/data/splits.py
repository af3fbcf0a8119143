"""Train / held-out split of a document list.

Held-out text measures how well the student matches the teacher on text neither saw during
distillation, so the split must be deterministic (same documents on every run and machine)
and, where the corpus allows it, meaningful:

* ``sotu``: addresses before 2000 train, 2000 and later are held out (a later era, new topics).
* ``moby-dick``: the last ~10% of chapters are held out (the end of the book).
* any other corpus of ≥ 2 documents: a document is held out when a SHA-256 of its id falls
  in the lowest 5% — stable as documents are added or removed, independent of file order;
  at least one document lands on each side.
* a single document: its text is cut at ~95% of its characters, on a paragraph boundary.
* a streamed hub corpus (:mod:`.sources`): the same hash rule, decided row by row as rows arrive
  (:func:`is_heldout_id`), so it holds out the documents a full download would.
* teacher-generated text: the same hash rule on the sample's id (``generated:<index>``).
"""

from __future__ import annotations

import hashlib
import math

from .document import Document
from .specs import parse_spec

SOTU_HELDOUT_FROM_YEAR = 2000
MOBY_DICK_HELDOUT_FRACTION = 0.10
HASH_HELDOUT_FRACTION = 0.05
SINGLE_DOC_TRAIN_FRACTION = 0.95


def split_documents(docs: list[Document], spec: str) -> tuple[list[Document], list[Document]]:
    """Return ``(train_docs, heldout_docs)`` for ``docs`` loaded from ``spec`` (rules above)."""
    base, _ = parse_spec(spec)
    docs = list(docs)
    if base == "sotu":
        train = [d for d in docs if d.meta["year"] < SOTU_HELDOUT_FROM_YEAR]
        return train, [d for d in docs if d.meta["year"] >= SOTU_HELDOUT_FROM_YEAR]
    if base == "moby-dick" and len(docs) >= 2:
        n_held = min(len(docs) - 1, max(1, math.ceil(len(docs) * MOBY_DICK_HELDOUT_FRACTION)))
        return docs[:-n_held], docs[-n_held:]
    if len(docs) == 1:
        return _split_single(docs[0])
    return _split_by_hash(docs)


def _id_score(doc_id: str) -> float:
    """A uniform number in [0, 1) fixed by the id alone (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big") / 2**64


def is_heldout_id(doc_id: str) -> bool:
    """The hash rule for one document: held out when its id's score falls in the lowest 5%."""
    return _id_score(doc_id) < HASH_HELDOUT_FRACTION


def _split_by_hash(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    if not docs:
        return [], []
    scores = {d.id: _id_score(d.id) for d in docs}
    held_ids = {i for i, s in scores.items() if s < HASH_HELDOUT_FRACTION}
    if len(docs) >= 2:
        ranked = sorted(scores, key=scores.get)
        if not held_ids:
            held_ids = {ranked[0]}
        elif len(held_ids) == len(docs):
            held_ids.discard(ranked[-1])
    return [d for d in docs if d.id not in held_ids], [d for d in docs if d.id in held_ids]


def _split_single(doc: Document) -> tuple[list[Document], list[Document]]:
    cut = _paragraph_cut(doc.text, SINGLE_DOC_TRAIN_FRACTION)
    head, tail = doc.text[:cut], doc.text[cut:]
    train = [Document(f"{doc.id}#train", head, {**doc.meta, "part": "train"})] if head.strip() else []
    held = [Document(f"{doc.id}#heldout", tail, {**doc.meta, "part": "heldout"})] if tail.strip() else []
    return train, held


def _paragraph_cut(text: str, fraction: float) -> int:
    """Index to cut ``text`` at: the boundary nearest ``fraction`` of its length.

    A blank line is preferred, then a line break, then a space, each searched only within
    5% of the text around the target so the held-out share stays near ``1 - fraction``;
    with no boundary there the cut falls on the exact character.
    """
    target = int(len(text) * fraction)
    window = max(1, len(text) // 20)
    lo, hi = max(1, target - window), min(len(text) - 1, target + window)
    for sep in ("\n\n", "\n", " "):
        before = text.rfind(sep, lo, target)
        after = text.find(sep, target, hi)
        options = [i + len(sep) for i in (before, after) if i != -1]
        if options:
            return min(options, key=lambda i: abs(i - target))
    return target
