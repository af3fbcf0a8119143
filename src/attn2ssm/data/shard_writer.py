"""Writing token shards (:mod:`.shards` has the format and reads them back).

Writing streams: ``ShardWriter.add`` appends ids as they come (a teacher sampling in large batches
never holds its corpus in memory), files roll over every ``shard_tokens``, and the folder appears
only when complete (written in a staging folder beside it, then renamed, with the umask's mode): a
killed writer leaves no half folder under the final name. ``write_corpus_shards`` writes any corpus
spec this way, tokenized document by document, sampled from the teacher or copied from other shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from attn2ssm.errors import DataError
from attn2ssm.paths import atomic_write_text, staging_dir, writing

from .shards import (
    DEFAULT_SHARD_TOKENS,
    PREFIX,
    SHARD_FORMAT,
    SIDES,
    check_file,
    id_dtype,
    id_limit,
    read_manifest,
)
from .sources import load_documents
from .specs import can_stream, is_generated, is_shards, parse_spec
from .splits import split_documents
from .teacher_samples import TeacherSampler
from .tokenize import Joiner, TokenizedCorpus, eos_id, stream_into, tokenize_into, tokenizer_fingerprint


class ShardWriter:
    """Appends token ids per side into files of ``shard_tokens`` ids; ``close`` writes the manifest
    and moves the finished folder into place (``abort`` drops it). Use it as a context manager.
    ``id_limit``: one past the largest id the files may hold when it exceeds the tokenizer's
    vocabulary (a teacher sampling from more embedding rows); readers refuse ids past it."""

    def __init__(
        self,
        out,
        tokenizer,
        *,
        source: str,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        meta: dict | None = None,
        id_limit: int | None = None,
    ):
        self.out = Path(out)
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            held = "token shards" if (self.out / "manifest.json").exists() else "other files"
            raise DataError(f"{self.out} already holds {held}", "choose another folder or remove it first")
        if shard_tokens < 1:
            raise DataError(
                f"shard_tokens={shard_tokens} is not a positive number of tokens", "use e.g. 33554432 (2^25)"
            )
        vocab = len(tokenizer)
        self.dtype, self.shard_tokens = id_dtype(vocab), int(shard_tokens)
        self.manifest = {
            "format": SHARD_FORMAT,
            "source": source,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "tokenizer_class": type(tokenizer).__name__,
            "vocab_size": vocab,
            "id_limit": max(vocab, int(id_limit or 0)),
            "eos_token_id": tokenizer.eos_token_id,
            "dtype": self.dtype.name,
            "sides": {s: [] for s in SIDES},
            "meta": dict(meta or {}),
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.staging = staging_dir(self.out, "shards")
        self._open = {}  # side -> (file handle, sha256, ids in the file)

    def add(self, side: str, ids) -> None:
        """Append ``ids`` (a 1-D tensor, array or list of ints) to ``side``."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        ids = (
            np.asarray(ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids)
            .astype(self.dtype, copy=False)
            .reshape(-1)
        )
        while ids.size:
            fh, digest, count = self._file(side)
            take = min(ids.size, self.shard_tokens - count)
            chunk = ids[:take].tobytes()
            fh.write(chunk)
            digest.update(chunk)
            self._open[side] = (fh, digest, count + take)
            ids = ids[take:]
            if count + take == self.shard_tokens:
                self._seal(side)

    @property
    def meta(self) -> dict:
        """What the manifest's ``meta`` will hold (update it before ``close``)."""
        return self.manifest["meta"]

    def tokens(self, side: str) -> int:
        return sum(f["tokens"] for f in self.manifest["sides"][side]) + (
            self._open[side][2] if side in self._open else 0
        )

    def _file(self, side: str):
        if side not in self._open:
            name = f"{side}-{len(self.manifest['sides'][side]):05d}.bin"
            self._open[side] = (open(self.staging / name, "wb"), hashlib.sha256(), 0)
            self.manifest["sides"][side].append({"file": name, "tokens": 0, "sha256": ""})
        return self._open[side]

    def _seal(self, side: str) -> None:
        fh, digest, count = self._open.pop(side)
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        self.manifest["sides"][side][-1].update(tokens=count, sha256=digest.hexdigest())

    def close(self) -> Path:
        for side in list(self._open):
            self._seal(side)
        atomic_write_text(self.staging / "manifest.json", json.dumps(self.manifest, indent=1))
        self.staging.chmod(_folder_mode())  # mkdtemp made it 0700; the folder gets the umask's mode
        os.replace(self.staging, self.out)
        return self.out

    def abort(self) -> None:
        for fh, _, _ in self._open.values():
            fh.close()
        self._open.clear()
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _folder_mode() -> int:
    """The mode a new folder gets under this process's umask (0755 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


class DocumentStream(Joiner):
    """Documents joined by EOS into one side of a :class:`ShardWriter`, cut at ``limit`` tokens: the
    stream a cached corpus holds (``packing.Joiner``), written as it comes instead of kept."""

    def __init__(self, writer: ShardWriter, side: str, eos: int, limit: int | None = None):
        super().__init__(eos, limit, side)
        self.writer, self.side = writer, side

    def add(self, ids) -> None:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        piece = torch.cat([self.sep.long(), ids]) if self.docs else ids
        if self.limit is not None:
            piece = piece[: max(self.limit - min(self.total, self.limit), 0)]
        if piece.numel():
            self.writer.add(self.side, piece)
        self.total += ids.numel() + bool(self.docs)
        self.docs += 1

    def ids(self) -> torch.Tensor:
        raise TypeError("a DocumentStream writes its ids to shards and keeps none")


def write_shards(
    out, corpus: TokenizedCorpus, tokenizer, *, source: str, shard_tokens: int = DEFAULT_SHARD_TOKENS
) -> Path:
    """A tokenized corpus (train and held-out streams) as a shard folder."""
    if corpus.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
        raise DataError(
            "the corpus was tokenized with another tokenizer than the one given",
            "pass the tokenizer that made it",
        )
    with ShardWriter(out, tokenizer, source=source, shard_tokens=shard_tokens, meta=corpus.meta) as writer:
        writer.add("train", corpus.train_ids)
        writer.add("heldout", corpus.heldout_ids)
    return Path(out)


# ----------------------------------------------------------------------------- writing a corpus


def write_corpus_shards(
    spec: str,
    out,
    tokenizer,
    *,
    teacher=None,
    seed: int = 0,
    max_train_tokens: int | None = None,
    max_heldout_tokens: int | None = None,
    text_field: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
) -> dict:
    """Any corpus spec as a token shard folder ``out``, streamed (memory: a batch, not the corpus); returns the manifest.

    * ``generated:...`` is sampled from ``teacher`` (:func:`generate_shards`);
    * ``shards:DIR`` is copied, cut to the limits (e.g. a large folder cut to what fits a transfer);
    * anything else (built-in name, files, ``hf:``) is tokenized document by document with the
      train / held-out split of :func:`.packing.prepare_corpus` and the same ids: a hub dataset is
      streamed row by row (read only as far as the limits need, the whole split without them), local
      and built-in corpora are read, split and tokenized in order.

    ``max_*_tokens`` cut each side as ``prepare_corpus`` does. A failure or an interrupt leaves no
    folder at ``out`` (:class:`ShardWriter`); a full disk or a denied write is a one-line
    :class:`~attn2ssm.errors.OutputError`."""
    for name, value in (("max_train_tokens", max_train_tokens), ("max_heldout_tokens", max_heldout_tokens)):
        if value is not None and value < 0:
            raise DataError(
                f"{name}={value} is negative", "give a number of tokens >= 0, or none for all of them"
            )
    if is_generated(spec) and teacher is None:
        raise DataError(f"{spec!r} is sampled from the teacher, and none was given", "pass teacher=")
    with writing(Path(out), "token shards", "run the command again (nothing was left at the output)"):
        if is_generated(spec):
            return generate_shards(
                spec,
                teacher,
                tokenizer,
                out,
                seed=seed,
                max_train_tokens=max_train_tokens,
                max_heldout_tokens=max_heldout_tokens,
                shard_tokens=shard_tokens,
                progress=progress,
            )
        if is_shards(spec):
            return _copy_shards(spec, out, tokenizer, max_train_tokens, max_heldout_tokens, shard_tokens)
        return _tokenize_shards(
            spec, out, tokenizer, max_train_tokens, max_heldout_tokens, text_field, shard_tokens
        )


def _tokenize_shards(
    spec: str,
    out,
    tokenizer,
    max_train: int | None,
    max_heldout: int | None,
    text_field: str | None,
    shard_tokens: int,
) -> dict:
    base, text_field = parse_spec(spec, text_field)
    eos, started = eos_id(tokenizer), time.perf_counter()
    with ShardWriter(
        out, tokenizer, source=base, shard_tokens=shard_tokens, meta={"spec": base, "text_field": text_field}
    ) as writer:
        train, held = (
            DocumentStream(writer, "train", eos, max_train),
            DocumentStream(writer, "heldout", eos, max_heldout),
        )
        if can_stream(base):
            counts = stream_into(train, held, base, text_field, tokenizer)
        else:
            train_docs, heldout_docs = split_documents(load_documents(base, text_field=text_field), base)
            tokenize_into(train, train_docs, tokenizer, "train")
            tokenize_into(held, heldout_docs, tokenizer, "held-out")
            counts = {"n_train_docs": len(train_docs), "n_heldout_docs": len(heldout_docs)}
        seconds = time.perf_counter() - started
        written = writer.tokens("train") + writer.tokens("heldout")
        writer.meta.update(
            **counts,
            max_train_tokens=max_train,
            max_heldout_tokens=max_heldout,
            seconds=round(seconds, 3),
            tokens_per_second=round(written / seconds, 1) if seconds else 0.0,
        )
    return writer.manifest


def _copy_shards(
    spec: str,
    out,
    tokenizer,
    max_train: int | None,
    max_heldout: int | None,
    shard_tokens: int,
    chunk: int = 1 << 24,
) -> dict:
    src = Path(spec[len(PREFIX) :])
    manifest = read_manifest(src)
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise DataError(
            f"the token shards in {src} were made with another tokenizer ({manifest['tokenizer_class']})",
            "use the teacher whose tokenizer wrote them",
        )
    dtype = np.dtype(manifest["dtype"])
    meta = {
        **manifest.get("meta", {}),
        "copied_from": str(src),
        "max_train_tokens": max_train,
        "max_heldout_tokens": max_heldout,
    }
    with ShardWriter(
        out,
        tokenizer,
        source=manifest["source"],
        shard_tokens=shard_tokens,
        meta=meta,
        id_limit=id_limit(manifest),
    ) as writer:
        for side, limit in (("train", max_train), ("heldout", max_heldout)):
            for entry in manifest["sides"][side]:
                check_file(src / entry["file"], entry, dtype, False, id_limit(manifest))
                with open(src / entry["file"], "rb") as fh:
                    for start in range(0, entry["tokens"], chunk):
                        left = (
                            entry["tokens"] - start
                            if limit is None
                            else min(entry["tokens"] - start, limit - writer.tokens(side))
                        )
                        if left <= 0:
                            break
                        writer.add(
                            side, np.frombuffer(fh.read(min(chunk, left) * dtype.itemsize), dtype=dtype)
                        )
    return writer.manifest


def generate_shards(
    spec: str,
    teacher,
    tokenizer,
    out,
    *,
    seed: int = 0,
    max_train_tokens: int | None = None,
    max_heldout_tokens: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
) -> dict:
    """The ``generated:`` corpus ``spec`` sampled straight into a token shard folder ``out``
    (:mod:`.shards`): the samples :func:`generate_corpus` would cache, in the same order and with the
    same split, written as each batch arrives (memory: one batch). ``max_*_tokens`` cut each side as
    they cut a cached corpus, and sampling stops once both sides are full. The manifest's ``meta``
    records the settings and the sampling rate (``tokens_per_second``, wall time with the writes).
    A failure or an interrupt leaves no folder at ``out``. Returns the manifest."""
    goal = (
        max_train_tokens + max_heldout_tokens
        if max_train_tokens is not None and max_heldout_tokens is not None
        else None
    )
    sampler = TeacherSampler(spec, teacher, tokenizer, seed=seed, progress=progress, goal=goal)
    with ShardWriter(
        out,
        tokenizer,
        source=spec,
        shard_tokens=shard_tokens,
        meta={"spec": spec, "generated": True},
        id_limit=teacher.config.get_text_config().vocab_size,  # it may sample past the tokenizer
    ) as writer:
        sides = {
            "train": DocumentStream(writer, "train", sampler.eos, max_train_tokens),
            "heldout": DocumentStream(writer, "heldout", sampler.eos, max_heldout_tokens),
        }
        with contextlib.closing(iter(sampler)) as samples:
            for sample in samples:
                sides[sample.side].add(sample.ids)
                if all(side.full for side in sides.values()):
                    break
        device = next(teacher.parameters()).device
        writer.meta.update(
            settings=sampler.settings,
            **sampler.stats(),
            device=str(device),
            teacher_dtype=str(next(teacher.parameters()).dtype).removeprefix("torch."),
            max_train_tokens=max_train_tokens,
            max_heldout_tokens=max_heldout_tokens,
        )
    return writer.manifest
