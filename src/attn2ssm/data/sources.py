"""Turn a corpus spec into a list of documents.

A *spec* is the one string a recipe uses to name its training text. Its grammar (parsing and
checking a spec without reading any text, and without torch) is :mod:`.specs`; the forms, and how
each is read, are:

* ``"sotu"`` / ``"moby-dick"`` — built-in corpora, fetched once (see :mod:`.builtin`); also the
  evaluation corpora ``"emails"``, ``"kjv"`` and ``"pydoc"``, which no built-in recipe trains on.
  A built-in name wins over a local folder of the same name; write ``./sotu`` for the folder.
* a path to a ``.txt`` file (one document), a ``.jsonl`` file (one document per line,
  text in field ``text``) or a ``.parquet`` file (one document per row, column ``text``);
* a directory: every such file below it, in sorted relative-path order, hidden entries skipped;
* ``"hf:<dataset>[:<config>][:<split>]"`` — a Hugging Face dataset via ``datasets.load_dataset``
  (split defaults to ``train`` and may be sliced, e.g. ``train[:1000]``; with one extra part,
  a well-known split name such as ``test`` is read as the split, anything else as the config).

Any spec may end in ``?field=<name>`` to read another text field; ``text_field=`` does the
same from code. Document ids are relative to the spec (never absolute paths) so that the
hash-based held-out split does not change when a corpus moves to another machine.

Hub datasets are *streamed* (``load_dataset(..., streaming=True)``) whenever the caller caps the
training tokens (``max_train_tokens``; in a recipe also a source's ``max_tokens`` or the run's
budget): rows are read in order only until both the training and the held-out stream are full, so
naming a large dataset downloads only what the run uses. An integer slice (``train[100:5000]``)
streams too; a percentage slice (``train[:10%]``) needs the split's length and is downloaded.
``<dataset>`` may also be a local folder of data files (``hf:/data/shards``: the same reader
as for a hub repository) or a folder written by ``Dataset.save_to_disk``.

``"generated:<n_tokens>[:<prompt corpus>][?option=value&…]"`` is text the teacher writes: ``n_tokens``
tokens sampled from the teacher, each sample started from the BOS token (EOS when there is none) or,
with a prompt corpus, from ``prompt_len`` tokens cut from that corpus' training text. It needs the
teacher, so it is read by :func:`attn2ssm.data.teacher_samples.generate_corpus` (the trainer does
this for ``data.corpus`` / ``data.sources``), not by :func:`load_documents`. Options (defaults):
``temperature`` (1.0), ``top_p`` (1.0: plain sampling), ``length`` (256 new tokens per sample, cut
to the teacher's context), ``prompt_len`` (16), ``batch`` (samples per ``generate`` call: 16 on a CPU; on a GPU, when not given,
as many as a quarter of its memory holds and the corpus needs, up to 1024 — see
:func:`attn2ssm.data.teacher_samples.sampling_batch`; part of the cache key, since the random draws
depend on it) and ``field`` (the prompt corpus' text field).
Example: ``generated:1000000:sotu?top_p=0.95&batch=64``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

from attn2ssm.errors import DataError

from . import builtin, recall
from .document import Document
from .specs import (
    FILE_SUFFIXES,
    is_mixture,
    is_recall,
    local_files,
    needs_teacher,
    no_text_files,
    parse_hf_spec,
    parse_recall_spec,
    parse_spec,
    row_slice,
)

_NETWORK_MODULES = {"requests", "httpx", "httpcore", "urllib3", "aiohttp"}


def load_documents(spec: str, *, text_field: str | None = None) -> list[Document]:
    """Read every document ``spec`` names; whitespace-only documents are dropped.

    Raises :class:`DataError` for a missing path, an unknown format, an unreachable hub,
    or a corpus without any text (``empty corpus``).
    """
    if needs_teacher(spec):
        raise DataError(
            f"{spec.strip()!r} is text the teacher writes, so it cannot be read without the teacher",
            "use it as data.corpus or in data.sources of a recipe (attn2ssm distill)",
        )
    if is_mixture(spec):
        raise DataError(
            f"{spec.strip()!r} names a mixture of several corpora, not one",
            "use it as data.corpus of a recipe, or name one of its corpora",
        )
    if is_recall(spec):
        return recall.load_recall(spec, load_documents)
    base, text_field = parse_spec(spec, text_field)
    if builtin.is_builtin(base):
        docs = builtin.load_builtin(base)
    elif base.startswith("hf:"):
        docs = _load_hf(base[3:], text_field)
    else:
        docs = _load_local(base, text_field)
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DataError(
            f"empty corpus: {spec!r} contains no non-whitespace text",
            f"check the file contents or the text field (now {text_field!r}; set it with ?field=NAME)",
        )
    return docs


# ------------------------------------------------------------------------------- generated


# ----------------------------------------------------------------------------- named mixtures


def corpus_stamp(spec: str) -> str:
    """A short string that changes when the text behind ``spec`` changes.

    Used in the tokenized-cache key: for local files it covers every file's relative path,
    size and modification time, so editing a corpus invalidates its cached tokens.
    Built-ins are pinned package versions and hub specs are keyed by name alone.
    """
    if is_recall(spec):  # the passages follow from the spec and the prose corpus' text
        return f"{spec.strip()}|format-{recall.FORMAT}|{corpus_stamp(parse_recall_spec(spec)[1])}"
    base, _ = parse_spec(spec)
    if builtin.is_builtin(base):
        return builtin.package_spec(base)
    if base.startswith("hf:"):
        return base
    root = Path(base).expanduser()
    files = local_files(root) if root.exists() else []
    items = [str(root.resolve())]
    for path in files:
        st = path.stat()
        items.append(
            f"{path.relative_to(root) if root.is_dir() else path.name}|{st.st_size}|{st.st_mtime_ns}"
        )
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- local


def _load_local(base: str, text_field: str) -> list[Document]:
    root = Path(base).expanduser()
    if not root.exists():
        raise DataError(
            f"corpus path {str(root)!r} does not exist",
            f"check the path, or use a built-in corpus ({', '.join(builtin.names())}) or hf:<dataset>",
        )
    if root.is_file() and not root.name.endswith(FILE_SUFFIXES):
        raise DataError(
            f"cannot read corpus file {str(root)!r}: unsupported format",
            f"use one of {', '.join(FILE_SUFFIXES)} or a directory of such files",
        )
    files = local_files(root)
    if not files:
        no_text_files(root)
    docs: list[Document] = []
    for path in files:
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        docs.extend(_read_file(path, rel, text_field))
    return docs


# A file named .txt / .jsonl whose bytes are not text (model weights, an archive, UTF-16) would
# otherwise be decoded with replacements and trained on. UTF-8 text never holds a NUL byte; random
# or compressed bytes decode to U+FFFD replacements and C0 control characters at tens of percent
# of their characters, while real text with a few bytes of another encoding stays far below.
_MAX_NOT_TEXT_SHARE = 0.10
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\x0b\x0c\x1b") + b"\x7f"
_NOT_TEXT_FIX = "point data.corpus at UTF-8 text (convert another encoding with `iconv -t UTF-8`), or move that file out of the corpus"


def decode_text(data: bytes, where: str) -> str:
    """``data`` as UTF-8 (the odd undecodable byte replaced by U+FFFD); a DataError naming
    ``where`` when the bytes are not text at all."""
    if b"\x00" in data:
        raise DataError(
            f"{where} is not text: it holds NUL bytes (a binary file, or UTF-16 text)", _NOT_TEXT_FIX
        )
    text = data.decode("utf-8", errors="replace")
    controls = len(data) - len(data.translate(None, _CONTROL_BYTES))
    share = (text.count("\ufffd") + controls) / max(len(text), 1)
    if share > _MAX_NOT_TEXT_SHARE:
        raise DataError(
            f"{where} is not text: {share:.0%} of its characters are invalid UTF-8 or control characters",
            _NOT_TEXT_FIX,
        )
    return text


def _read_file(path: Path, rel: str, text_field: str) -> list[Document]:
    if path.suffix == ".txt":
        return [Document(rel, decode_text(path.read_bytes(), f"corpus file {path}"), {"source": rel})]
    if path.suffix == ".jsonl":
        return _read_jsonl(path, rel, text_field)
    return _read_parquet(path, rel, text_field)


def _read_jsonl(path: Path, rel: str, text_field: str) -> list[Document]:
    docs = []
    text = decode_text(path.read_bytes(), f"corpus file {path}")
    for lineno, line in enumerate(text.split("\n"), 1):  # (not splitlines: JSON strings may hold U+2028)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg})", "fix or remove that line") from e
        text_value = _field(record, text_field, f"{path}:{lineno}")
        docs.append(Document(f"{rel}:{lineno}", text_value, {"source": rel, "line": lineno}))
    return docs


def _read_parquet(path: Path, rel: str, text_field: str) -> list[Document]:
    import pyarrow.parquet as pq  # heavy: pyarrow, only for .parquet files

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"cannot read parquet file {path} ({e})", "check that the file is complete") from e
    if text_field not in table.column_names:
        raise DataError(
            f"parquet file {path} has no column {text_field!r} (columns: {', '.join(table.column_names)})",
            "choose the text column with ?field=NAME",
        )
    texts = table.column(text_field).to_pylist()
    return [
        Document(f"{rel}:{i}", _as_text(t, f"{path} row {i}", text_field), {"source": rel, "row": i})
        for i, t in enumerate(texts)
    ]


def _field(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where} has no field {text_field!r} (has: {keys})",
            "choose the text field with ?field=NAME",
        )
    return _as_text(record[text_field], where, text_field)


def _as_text(value, where: str, text_field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {text_field!r} is {type(value).__name__}, not text",
            "point ?field= at a string field",
        )
    return value


# ------------------------------------------------------------------------------------- hub


def open_hf_dataset(
    rest: str,
    offline_fix: str = "use a local .txt/.jsonl/.parquet file or directory, or a built-in corpus (sotu, moby-dick)",
    *,
    streaming: bool = False,
):
    """``datasets.load_dataset`` for ``hf:<rest>``, every failure turned into a one-line DataError.

    ``streaming=True`` returns an ``IterableDataset`` (the split's integer slice applied with
    skip/take); a folder written by ``save_to_disk`` is opened with ``load_from_disk``.
    """
    name, config, split = parse_hf_spec(rest)
    import datasets  # heavy: datasets, only for hf: specs
    from datasets.exceptions import DatasetNotFoundError  # heavy: as above

    label = f"hf:{rest}"
    try:
        if _is_saved_dataset(name):
            return _open_saved(name, config, split, label, streaming)
        if not streaming:
            return datasets.load_dataset(name, config, split=split)
        cut = row_slice(split)
        if cut is None:
            raise DataError(
                f"cannot stream {label!r}: split {split!r} is not a plain or integer-sliced split",
                "write e.g. train or train[1000:50000]",
            )
        split_name, start, stop = cut
        ds = datasets.load_dataset(name, config, split=split_name, streaming=True)
        ds = ds.skip(start) if start else ds
        return ds.take(stop - start) if stop is not None else ds
    except DatasetNotFoundError as e:
        raise DataError(
            f"dataset {name!r} was not found on the Hugging Face Hub",
            "check the name, or log in for gated datasets",
        ) from e
    except ValueError as e:  # unknown config or split
        raise DataError(f"cannot load {label!r}: {_first_line(e)}", "check the config and split names") from e
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise DataError(
            f"the Hugging Face Hub is unreachable, so {label!r} cannot be loaded ({_first_line(e)})",
            offline_fix,
        ) from e


def _is_saved_dataset(name: str) -> bool:
    path = Path(name).expanduser()
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _open_saved(name: str, config, split: str, label: str, streaming: bool):
    import datasets  # heavy: datasets, only for hf: specs

    cut = row_slice(split)
    if config is not None or cut is None:
        raise DataError(
            f"cannot read {label!r}: a save_to_disk folder has no configs and takes integer slices only",
            "write hf:<folder>[:<split>[start:stop]]",
        )
    split_name, start, stop = cut
    ds = datasets.load_from_disk(str(Path(name).expanduser()))
    if isinstance(ds, datasets.DatasetDict):
        if split_name not in ds:
            raise DataError(
                f"{label!r} has no split {split_name!r} (splits: {', '.join(ds)})", "check the split name"
            )
        ds = ds[split_name]
    ds = ds.select(range(min(start, len(ds)), len(ds) if stop is None else min(stop, len(ds))))
    return ds.to_iterable_dataset() if streaming else ds


def _load_hf(rest: str, text_field: str) -> list[Document]:
    label = f"hf:{rest}"
    ds = open_hf_dataset(rest)
    if text_field not in ds.column_names:
        raise DataError(
            f"{label!r} has no column {text_field!r} (columns: {', '.join(ds.column_names)})",
            "choose the text column with ?field=NAME",
        )
    return [
        Document(f"{label}:{i}", _as_text(t, f"{label} row {i}", text_field), {"source": label, "row": i})
        for i, t in enumerate(ds[text_field])
    ]


def iter_hf_documents(spec: str, *, text_field: str | None = None):
    """Stream the documents of hub spec ``spec`` one row at a time (see :func:`can_stream`).

    Ids and order are those :func:`load_documents` gives, so the held-out split is the same; rows are
    fetched only as the caller asks for them, and a connection lost mid-stream is a one-line DataError.
    """
    base, text_field = parse_spec(spec, text_field)
    label = base
    ds = open_hf_dataset(base[3:], streaming=True)
    columns = ds.column_names  # None when the features are only known once rows arrive
    if columns is not None and text_field not in columns:
        raise DataError(
            f"{label!r} has no column {text_field!r} (columns: {', '.join(columns)})",
            "choose the text column with ?field=NAME",
        )
    rows = iter(ds)
    for i in itertools.count():
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:
            if not _is_network_error(e):
                raise
            raise DataError(
                f"the Hugging Face Hub became unreachable while streaming {label!r} at row {i} ({_first_line(e)})",
                "run again when the connection is back (the tokens read so far are not cached)",
            ) from e
        text = _field(row, text_field, f"{label} row {i}")
        if text.strip():
            yield Document(f"{label}:{i}", text, {"source": label, "row": i})


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _is_network_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed connection, whichever HTTP stack raised it."""
    seen = 0
    while exc is not None and seen < 10:
        module = type(exc).__module__.split(".")[0]
        if isinstance(exc, (ConnectionError, TimeoutError)) or module in _NETWORK_MODULES:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
