"""Token shards: a corpus tokenized (or sampled from the teacher) once, kept as token ids on disk.

A shard folder holds, per side (``train``, ``heldout``), files of consecutive token ids —
``uint16`` when the vocabulary fits in 16 bits (SmolLM2's 49,152 does), else ``uint32`` — and a
``manifest.json`` naming the tokenizer they belong to (``tokenizer_fingerprint``), the EOS id that
joins documents, each file's token count and SHA-256, and where the ids came from. Ids, not text:
the folder is what travels to a machine with no network (2^25 tokens = 64 MiB at 16 bits), and a
run there reads it without tokenizing anything (``data.corpus: shards:DIR``; a mixture of folders
is ``data.sources``).

Writing them is :mod:`.shard_writer`'s (streamed, staged, moved into place when complete). Reading
checks the manifest (format, tokenizer,
sizes, ids below the vocabulary; ``verify=True`` also the hashes: :func:`check_shards`, the
one validator ``data info``, ``eval`` and training share) and returns a ``TokenizedCorpus`` like any other source.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from attn2ssm.errors import DataError

from .specs import SHARDS_PREFIX, is_shards
from .tokenize import TokenizedCorpus, tokenizer_fingerprint

SHARD_FORMAT = 1
SIDES = ("train", "heldout")
PREFIX = SHARDS_PREFIX
DEFAULT_SHARD_TOKENS = 1 << 25  # 64 MiB a file at 16 bits


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned width that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def read_manifest(path) -> dict:
    """The manifest of the shard folder ``path``, refused in one line when it is missing, not JSON,
    of another format, or lacks a field a reader needs (``sides``, ``dtype``, each file's entry, ...)."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise DataError(
            f"{path} holds no token shards (manifest.json missing)",
            "write them with 'attn2ssm data shards', or check the path",
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{path / 'manifest.json'} is not readable JSON ({exc.__class__.__name__})",
            "write the shards again",
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != SHARD_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(
            f"{path} holds shards of format {found!r}, this attn2ssm reads {SHARD_FORMAT}",
            "write them again with this attn2ssm",
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise DataError(
            f"{path / 'manifest.json'} is damaged: {problem}",
            "copy the shard folder again, or write the shards again with 'attn2ssm data shards'",
        )
    return manifest


_MANIFEST_FIELDS = {
    "source": str,
    "tokenizer_fingerprint": str,
    "tokenizer_class": str,
    "vocab_size": int,
    "dtype": str,
    "sides": dict,
}


def _manifest_problem(manifest: dict) -> str | None:
    """What a manifest lacks for a reader, in a few words (None: nothing)."""
    for key, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            return f"its {key!r} is {'missing' if key not in manifest else 'not a ' + kind.__name__}"
    if manifest["dtype"] not in ("uint16", "uint32"):
        return f"its 'dtype' {manifest['dtype']!r} is neither uint16 nor uint32"
    if not isinstance(manifest.get("id_limit", 1), int) or manifest["vocab_size"] < 1:
        return "its vocabulary size is not a positive number of ids"
    for side in SIDES:
        files = manifest["sides"].get(side)
        if not isinstance(files, list):
            return f"its 'sides' has no {side!r} list of files"
        for entry in files:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("file"), str)
                and Path(entry["file"]).name == entry["file"]
                and isinstance(entry.get("tokens"), int)
                and entry["tokens"] >= 0
                and isinstance(entry.get("sha256"), str)
            ):
                return f"an entry of its {side!r} files is not {{file, tokens, sha256}}: {str(entry)[:60]}"
    return None


def id_limit(manifest: dict) -> int:
    """One past the largest id the shards may hold: the tokenizer's vocabulary (a teacher's embedding
    rows when it sampled them and has more)."""
    return max(manifest["vocab_size"], manifest.get("id_limit", 0))


def read_shards(
    path,
    tokenizer,
    *,
    verify: bool = False,
    max_train_tokens: int | None = None,
    max_heldout_tokens: int | None = None,
    compact: bool = False,
) -> TokenizedCorpus:
    """The shard folder ``path`` as a ``TokenizedCorpus``, refused when its ids belong to another
    tokenizer or a file's size does not match the manifest (``verify``: the hash too). ``max_*_tokens``
    read only the first that many ids of a side. Ids are int64 tensors, or with ``compact`` the files'
    own width (``torch.uint16``; ``torch.int32`` for 32-bit files), a quarter or half of the memory:
    what :func:`attn2ssm.data.mixture.load_training_data` keeps with ``compact=True``."""
    path = Path(path[len(PREFIX) :] if is_shards(path) else path)
    manifest = read_manifest(path)
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise DataError(
            f"the token shards in {path} were made with another tokenizer ({manifest['tokenizer_class']})",
            "use the teacher whose tokenizer wrote them, or write the shards again",
        )
    sides = {
        side: _read_side(path, manifest, side, limit, verify, compact)
        for side, limit in (("train", max_train_tokens), ("heldout", max_heldout_tokens))
    }
    meta = {
        **manifest.get("meta", {}),
        "spec": f"{PREFIX}{path}",
        "shards": str(path),
        "source": manifest["source"],
        "n_train_tokens": int(sides["train"].numel()),
        "n_heldout_tokens": int(sides["heldout"].numel()),
        "from_cache": True,
    }
    return TokenizedCorpus(sides["train"], sides["heldout"], manifest["tokenizer_fingerprint"], meta)


def compact_dtype(vocab_size: int) -> torch.dtype:
    """The in-memory width of compact ids: ``torch.uint16`` when the vocabulary fits, else ``torch.int32``."""
    return torch.uint16 if id_dtype(vocab_size).itemsize == 2 else torch.int32


def _memory_dtype(dtype: np.dtype) -> np.dtype:
    # ids < 2^31: a uint32 file reads as int32, which torch fully supports
    return dtype if dtype.itemsize == 2 else np.dtype("<i4")


_LARGEST_IDS: dict[tuple, int] = {}  # (file, size, mtime) -> its largest id: each file scanned once a process


def _largest_id(file: Path, dtype: np.dtype) -> int:
    """The largest id in ``file`` (-1 when empty): one vectorised pass over a memory map, cached."""
    stat = file.stat()
    key = (str(file.absolute()), stat.st_size, stat.st_mtime_ns, dtype.str)
    if key not in _LARGEST_IDS:
        ids = np.memmap(file, dtype=dtype, mode="r") if stat.st_size >= dtype.itemsize else None
        _LARGEST_IDS[key] = int(ids.max()) if ids is not None else -1
        del ids
    return _LARGEST_IDS[key]


def check_file(file: Path, entry: dict, dtype: np.dtype, verify: bool, limit: int) -> None:
    """One id file against its manifest entry: its size, every id below ``limit`` (a damaged file
    would index past the embedding), and with ``verify`` its SHA-256."""
    size = file.stat().st_size if file.is_file() else -1
    if size != entry["tokens"] * dtype.itemsize:
        raise DataError(
            f"token shard {file} holds {max(size, 0)} bytes, the manifest says {entry['tokens'] * dtype.itemsize}",
            "copy the shard folder again (a transfer was cut short?)",
        )
    if verify:
        with open(file, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        if digest != entry["sha256"]:
            raise DataError(
                f"token shard {file} does not match its SHA-256 in the manifest",
                "copy the shard folder again",
            )
    largest = _largest_id(file, dtype)
    if largest >= limit:
        raise DataError(
            f"token shard {file} holds id {largest}, past the {limit:,} ids of the tokenizer that wrote it (a damaged file)",
            "copy the shard folder again, or write the shards again",
        )


def _read_side(
    path: Path,
    manifest: dict,
    side: str,
    limit: int | None,
    verify: bool,
    compact: bool = False,
) -> torch.Tensor:
    """One side's ids in one preallocated array, read file by file (never two copies of the side),
    each file checked first (:func:`check_file`)."""
    files, dtype, counts, left = manifest["sides"][side], np.dtype(manifest["dtype"]), [], limit
    for entry in files:
        if left is not None and left <= 0:
            break
        check_file(path / entry["file"], entry, dtype, verify, id_limit(manifest))
        counts.append(entry["tokens"] if left is None else min(left, entry["tokens"]))
        left = None if left is None else left - counts[-1]
    memory = _memory_dtype(dtype) if compact else np.dtype(np.int64)
    out, pos = np.empty(sum(counts), dtype=memory), 0
    for entry, count in zip(files, counts):
        if memory.itemsize == dtype.itemsize:  # the file's own width: read straight into place
            with open(path / entry["file"], "rb") as fh:
                fh.readinto(memoryview(out[pos : pos + count]).cast("B"))
        else:
            out[pos : pos + count] = np.fromfile(path / entry["file"], dtype=dtype, count=count)
        pos += count
    return torch.from_numpy(out)


def check_shards(path, *, verify: bool = False) -> dict:
    """Check the shard folder ``path`` without a tokenizer, as reading it would: the manifest's
    fields, every file's size and ids (below the vocabulary), and with ``verify`` its SHA-256;
    returns the manifest. Raises :class:`DataError` naming the first problem."""
    path = Path(path[len(PREFIX) :] if is_shards(path) else path)
    manifest = read_manifest(path)
    dtype, limit = np.dtype(manifest["dtype"]), id_limit(manifest)
    for side in SIDES:
        for entry in manifest["sides"][side]:
            check_file(path / entry["file"], entry, dtype, verify, limit)
    return manifest


def shard_bytes(manifest: dict, side: str | None = None) -> int:
    """Bytes of the id files of ``side`` (or both sides) a manifest lists."""
    item = np.dtype(manifest["dtype"]).itemsize
    return sum(f["tokens"] * item for s in ([side] if side else SIDES) for f in manifest["sides"][s])


def side_tokens(manifest: dict, side: str) -> int:
    return sum(f["tokens"] for f in manifest["sides"][side])
