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
sizes, ids below the vocabulary; ``verify=True`` also the hashes: :func:`check_shards`, the
one validator ``data info``, ``eval`` and training share) and returns a ``TokenizedCorpus`` like any other source.
"""

from __future__ import annotations

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

from .packing import TokenizedCorpus, _eos_id, _Joiner, stream_into, tokenize_into, tokenizer_fingerprint
from .sources import SHARDS_PREFIX, can_stream, is_generated, load_documents, parse_spec
from .splits import split_documents

SHARD_FORMAT = 1
SIDES = ("train", "heldout")
PREFIX = SHARDS_PREFIX
DEFAULT_SHARD_TOKENS = 1 << 25  # 64 MiB a file at 16 bits


def is_shards(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned width that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


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


class DocumentStream(_Joiner):
    """Documents joined by EOS into one side of a :class:`ShardWriter`, cut at ``limit`` tokens: the
    stream a cached corpus holds (``packing._Joiner``), written as it comes instead of kept."""

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
    return (
        dtype if dtype.itemsize == 2 else np.dtype("<i4")
    )  # ids < 2^31: a uint32 file reads as int32, which torch fully supports


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


def _check_file(file: Path, entry: dict, dtype: np.dtype, verify: bool, limit: int) -> None:
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
    each file checked first (:func:`_check_file`)."""
    files, dtype, counts, left = manifest["sides"][side], np.dtype(manifest["dtype"]), [], limit
    for entry in files:
        if left is not None and left <= 0:
            break
        _check_file(path / entry["file"], entry, dtype, verify, id_limit(manifest))
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
            _check_file(path / entry["file"], entry, dtype, verify, limit)
    return manifest


def shard_bytes(manifest: dict, side: str | None = None) -> int:
    """Bytes of the id files of ``side`` (or both sides) a manifest lists."""
    item = np.dtype(manifest["dtype"]).itemsize
    return sum(f["tokens"] * item for s in ([side] if side else SIDES) for f in manifest["sides"][s])


def side_tokens(manifest: dict, side: str) -> int:
    return sum(f["tokens"] for f in manifest["sides"][side])


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

    * ``generated:...`` is sampled from ``teacher`` (:func:`.teacher_samples.generate_shards`);
    * ``shards:DIR`` is copied, cut to the limits (e.g. a large folder cut to what fits a transfer);
    * anything else (built-in name, files, ``hf:``) is tokenized document by document with the
      train / held-out split of :func:`.packing.prepare_corpus` and the same ids: a hub dataset is
      streamed row by row (read only as far as the limits need, the whole split without them), local
      and built-in corpora are read, split and tokenized in order.

    ``max_*_tokens`` cut each side as ``prepare_corpus`` does. A failure or an interrupt leaves no
    folder at ``out`` (:class:`ShardWriter`); a full disk or a denied write is a one-line
    :class:`~attn2ssm.errors.OutputError`."""
    with writing(Path(out), "token shards", "run the command again (nothing was left at the output)"):
        return _write_corpus_shards(
            spec,
            out,
            tokenizer,
            teacher,
            seed,
            max_train_tokens,
            max_heldout_tokens,
            text_field,
            shard_tokens,
            progress,
        )


def _write_corpus_shards(
    spec,
    out,
    tokenizer,
    teacher,
    seed,
    max_train_tokens,
    max_heldout_tokens,
    text_field,
    shard_tokens,
    progress,
) -> dict:
    for name, value in (("max_train_tokens", max_train_tokens), ("max_heldout_tokens", max_heldout_tokens)):
        if value is not None and value < 0:
            raise DataError(
                f"{name}={value} is negative", "give a number of tokens >= 0, or none for all of them"
            )
    if is_generated(spec):
        if teacher is None:
            raise DataError(f"{spec!r} is sampled from the teacher, and none was given", "pass teacher=")
        from .teacher_samples import generate_shards  # (teacher_samples imports this module)

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
    eos, started = _eos_id(tokenizer), time.perf_counter()
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
                _check_file(src / entry["file"], entry, dtype, False, id_limit(manifest))
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
