"""Token shards: a corpus tokenized (or sampled from the teacher) once, kept as token ids on disk.

A shard folder holds, per side (``train``, ``heldout``), files of consecutive token ids —
``uint16`` when the vocabulary fits in 16 bits (SmolLM2's 49,152 does), else ``uint32`` — and a
``manifest.json`` naming the tokenizer they belong to (``tokenizer_fingerprint``), the EOS id that
joins documents, each file's token count and SHA-256, and where the ids came from. Ids, not text:
the folder is what travels to a machine with no network (2^25 tokens = 64 MiB at 16 bits), and a
run there reads it without tokenizing anything (``data.corpus: shards:DIR``; a mixture of folders
is ``data.sources``).

Writing streams: ``ShardWriter.add`` appends ids as they come (a teacher sampling in large
batches never holds its corpus in memory), files roll over every ``shard_tokens``, and the folder
appears only when complete (written in a staging folder beside it, then renamed): a killed writer
leaves no half folder under the final name. Reading checks the manifest (format, tokenizer,
sizes; ``verify=True`` also the hashes) and returns a ``TokenizedCorpus`` like any other source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from attn2ssm.errors import DataError
from attn2ssm.paths import atomic_write_text, staging_dir

from .packing import TokenizedCorpus, tokenizer_fingerprint

SHARD_FORMAT = 1
SIDES = ("train", "heldout")
PREFIX = "shards:"
DEFAULT_SHARD_TOKENS = 1 << 25  # 64 MiB a file at 16 bits


def is_shards(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned width that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class ShardWriter:
    """Appends token ids per side into files of ``shard_tokens`` ids; ``close`` writes the manifest
    and moves the finished folder into place (``abort`` drops it). Use it as a context manager."""

    def __init__(self, out, tokenizer, *, source: str, shard_tokens: int = DEFAULT_SHARD_TOKENS, meta: dict | None = None):
        self.out = Path(out)
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            held = "token shards" if (self.out / "manifest.json").exists() else "other files"
            raise DataError(f"{self.out} already holds {held}", "choose another folder or remove it first")
        if shard_tokens < 1:
            raise DataError(f"shard_tokens={shard_tokens} is not a positive number of tokens", "use e.g. 33554432 (2^25)")
        vocab = len(tokenizer)
        self.dtype, self.shard_tokens = id_dtype(vocab), int(shard_tokens)
        self.manifest = {"format": SHARD_FORMAT, "source": source, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                         "tokenizer_class": type(tokenizer).__name__, "vocab_size": vocab, "eos_token_id": tokenizer.eos_token_id,
                         "dtype": self.dtype.name, "sides": {s: [] for s in SIDES}, "meta": dict(meta or {})}  # fmt: skip
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.staging = staging_dir(self.out, "shards")
        self._open = {}  # side -> (file handle, sha256, ids in the file)

    def add(self, side: str, ids) -> None:
        """Append ``ids`` (a 1-D tensor, array or list of ints) to ``side``."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        ids = np.asarray(ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids).astype(self.dtype, copy=False).reshape(-1)
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

    def tokens(self, side: str) -> int:
        return sum(f["tokens"] for f in self.manifest["sides"][side]) + (self._open[side][2] if side in self._open else 0)

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


def write_shards(out, corpus: TokenizedCorpus, tokenizer, *, source: str, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Path:
    """A tokenized corpus (train and held-out streams) as a shard folder."""
    if corpus.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
        raise DataError("the corpus was tokenized with another tokenizer than the one given", "pass the tokenizer that made it")
    with ShardWriter(out, tokenizer, source=source, shard_tokens=shard_tokens, meta=corpus.meta) as writer:
        writer.add("train", corpus.train_ids)
        writer.add("heldout", corpus.heldout_ids)
    return Path(out)


def read_manifest(path) -> dict:
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise DataError(f"{path} holds no token shards (manifest.json missing)", "write them with 'attn2ssm data shards', or check the path") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path / 'manifest.json'} is not readable JSON ({exc.__class__.__name__})", "write the shards again") from None
    if manifest.get("format") != SHARD_FORMAT:
        raise DataError(f"{path} holds shards of format {manifest.get('format')!r}, this attn2ssm reads {SHARD_FORMAT}", "write them again with this attn2ssm")
    return manifest


def read_shards(path, tokenizer, *, verify: bool = False, max_train_tokens: int | None = None, max_heldout_tokens: int | None = None) -> TokenizedCorpus:
    """The shard folder ``path`` as a ``TokenizedCorpus`` (ids as int64 tensors), refused when its
    ids belong to another tokenizer or a file's size does not match the manifest (``verify``: the
    hash too). ``max_*_tokens`` read only the first that many ids of a side."""
    path = Path(path[len(PREFIX) :] if is_shards(path) else path)
    manifest = read_manifest(path)
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise DataError(f"the token shards in {path} were made with another tokenizer ({manifest['tokenizer_class']})",
                        "use the teacher whose tokenizer wrote them, or write the shards again")  # fmt: skip
    dtype = np.dtype(manifest["dtype"])
    sides = {side: _read_side(path, manifest["sides"][side], dtype, limit, verify)
             for side, limit in (("train", max_train_tokens), ("heldout", max_heldout_tokens))}  # fmt: skip
    meta = {**manifest.get("meta", {}), "spec": f"{PREFIX}{path}", "shards": str(path), "source": manifest["source"],
            "n_train_tokens": int(sides["train"].numel()), "n_heldout_tokens": int(sides["heldout"].numel()), "from_cache": True}  # fmt: skip
    return TokenizedCorpus(sides["train"], sides["heldout"], manifest["tokenizer_fingerprint"], meta)


def _read_side(path: Path, files: list[dict], dtype: np.dtype, limit: int | None, verify: bool) -> torch.Tensor:
    parts, left = [], limit
    for entry in files:
        if left is not None and left <= 0:
            break
        file = path / entry["file"]
        size = file.stat().st_size if file.is_file() else -1
        if size != entry["tokens"] * dtype.itemsize:
            raise DataError(f"token shard {file} holds {max(size, 0)} bytes, the manifest says {entry['tokens'] * dtype.itemsize}",
                            "copy the shard folder again (a transfer was cut short?)")  # fmt: skip
        if verify and hashlib.sha256(file.read_bytes()).hexdigest() != entry["sha256"]:
            raise DataError(f"token shard {file} does not match its SHA-256 in the manifest", "copy the shard folder again")
        count = entry["tokens"] if left is None else min(left, entry["tokens"])
        parts.append(np.fromfile(file, dtype=dtype, count=count).astype(np.int64))
        left = None if left is None else left - count
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)
