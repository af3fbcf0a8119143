"""Turn a corpus spec into a list of documents.

A *spec* is the one string a recipe uses to name its training text, so every way of
naming text lives here:

* ``"sotu"`` / ``"moby-dick"`` — built-in corpora, fetched once (see :mod:`.builtin`).
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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from attn2ssm.errors import DataError

from . import builtin

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
DEFAULT_TEXT_FIELD = "text"
_NETWORK_MODULES = {"requests", "httpx", "httpcore", "urllib3", "aiohttp"}
_SPLIT_NAMES = {"train", "validation", "valid", "test", "dev", "all"}


@dataclass
class Document:
    """One unit of text; ``id`` is stable and unique within its corpus."""

    id: str
    text: str
    meta: dict = field(default_factory=dict)


def load_documents(spec: str, *, text_field: str | None = None) -> list[Document]:
    """Read every document ``spec`` names; whitespace-only documents are dropped.

    Raises :class:`DataError` for a missing path, an unknown format, an unreachable hub,
    or a corpus without any text (``empty corpus``).
    """
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


def parse_spec(spec: str, text_field: str | None = None) -> tuple[str, str]:
    """Split ``"base?field=x"`` into ``(base, text_field)``; a conflicting argument is an error."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(
            "no corpus given",
            "set data.corpus to a built-in name, a file, a directory or hf:<dataset>",
        )
    spec = spec.strip()
    query_field = None
    base, sep, query = spec.rpartition("?")
    if sep and query and "=" in query:
        for pair in query.split("&"):
            key, _, value = pair.partition("=")
            if key != "field" or not value:
                raise DataError(
                    f"unknown corpus option {pair!r} in {spec!r}",
                    "the only option is ?field=<text field>",
                )
            query_field = value
    else:
        base = spec
    if text_field and query_field and text_field != query_field:
        raise DataError(
            f"text field given twice: {query_field!r} in the spec and {text_field!r} as an argument",
            "keep one of them",
        )
    return base, text_field or query_field or DEFAULT_TEXT_FIELD


def corpus_stamp(spec: str) -> str:
    """A short string that changes when the text behind ``spec`` changes.

    Used in the tokenized-cache key: for local files it covers every file's relative path,
    size and modification time, so editing a corpus invalidates its cached tokens.
    Built-ins are pinned package versions and hub specs are keyed by name alone.
    """
    base, _ = parse_spec(spec)
    if builtin.is_builtin(base):
        return builtin.package_spec(base)
    if base.startswith("hf:"):
        return base
    root = Path(base).expanduser()
    files = _local_files(root) if root.exists() else []
    items = [str(root.resolve())]
    for path in files:
        st = path.stat()
        items.append(
            f"{path.relative_to(root) if root.is_dir() else path.name}|{st.st_size}|{st.st_mtime_ns}"
        )
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- local


def _local_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.endswith(FILE_SUFFIXES):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _load_local(base: str, text_field: str) -> list[Document]:
    root = Path(base).expanduser()
    if not root.exists():
        raise DataError(
            f"corpus path {str(root)!r} does not exist",
            "check the path, or use a built-in corpus (sotu, moby-dick) or hf:<dataset>",
        )
    if root.is_file() and not root.name.endswith(FILE_SUFFIXES):
        raise DataError(
            f"cannot read corpus file {str(root)!r}: unsupported format",
            f"use one of {', '.join(FILE_SUFFIXES)} or a directory of such files",
        )
    files = _local_files(root)
    if not files:
        raise DataError(
            f"directory {str(root)!r} holds no {', '.join(FILE_SUFFIXES)} files",
            "point data.corpus at a folder with text files",
        )
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
        raise DataError(f"{where} is not text: it holds NUL bytes (a binary file, or UTF-16 text)", _NOT_TEXT_FIX)
    text = data.decode("utf-8", errors="replace")
    controls = len(data) - len(data.translate(None, _CONTROL_BYTES))
    share = (text.count("\ufffd") + controls) / max(len(text), 1)
    if share > _MAX_NOT_TEXT_SHARE:
        raise DataError(f"{where} is not text: {share:.0%} of its characters are invalid UTF-8 or control characters", _NOT_TEXT_FIX)
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
            raise DataError(
                f"{path}:{lineno} is not valid JSON ({e.msg})", "fix or remove that line"
            ) from e
        text_value = _field(record, text_field, f"{path}:{lineno}")
        docs.append(Document(f"{rel}:{lineno}", text_value, {"source": rel, "line": lineno}))
    return docs


def _read_parquet(path: Path, rel: str, text_field: str) -> list[Document]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(
            f"cannot read parquet file {path} ({e})", "check that the file is complete"
        ) from e
    if text_field not in table.column_names:
        raise DataError(
            f"parquet file {path} has no column {text_field!r} (columns: {', '.join(table.column_names)})",
            "choose the text column with ?field=NAME",
        )
    texts = table.column(text_field).to_pylist()
    return [
        Document(
            f"{rel}:{i}", _as_text(t, f"{path} row {i}", text_field), {"source": rel, "row": i}
        )
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


def parse_hf_spec(rest: str) -> tuple[str, str | None, str]:
    """``"name[:config][:split]"`` → ``(name, config, split)``; see the module docstring."""
    parts = re.split(
        r":(?![^\[]*\])", rest
    )  # a ':' inside a slice like train[:100] is not a separator
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise DataError(
            f"bad hub corpus spec 'hf:{rest}'", "write hf:<dataset>[:<config>][:<split>]"
        )
    name, config, split = parts[0], None, "train"
    if len(parts) == 3:
        config, split = parts[1], parts[2]
    elif len(parts) == 2:
        if parts[1].split("[")[0] in _SPLIT_NAMES or "[" in parts[1]:
            split = parts[1]
        else:
            config = parts[1]
    return name, config, split


def open_hf_dataset(
    rest: str,
    offline_fix: str = "use a local .txt/.jsonl/.parquet file or directory, or a built-in corpus (sotu, moby-dick)",
):
    """``datasets.load_dataset`` for ``hf:<rest>``, every failure turned into a one-line DataError."""
    name, config, split = parse_hf_spec(rest)
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    label = f"hf:{rest}"
    try:
        return datasets.load_dataset(name, config, split=split)
    except DatasetNotFoundError as e:
        raise DataError(
            f"dataset {name!r} was not found on the Hugging Face Hub",
            "check the name, or log in for gated datasets",
        ) from e
    except ValueError as e:  # unknown config or split
        raise DataError(
            f"cannot load {label!r}: {str(e).splitlines()[0]}", "check the config and split names"
        ) from e
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise DataError(
            f"the Hugging Face Hub is unreachable, so {label!r} cannot be loaded ({e})", offline_fix
        ) from e


def _load_hf(rest: str, text_field: str) -> list[Document]:
    label = f"hf:{rest}"
    ds = open_hf_dataset(rest)
    if text_field not in ds.column_names:
        raise DataError(
            f"{label!r} has no column {text_field!r} (columns: {', '.join(ds.column_names)})",
            "choose the text column with ?field=NAME",
        )
    return [
        Document(
            f"{label}:{i}", _as_text(t, f"{label} row {i}", text_field), {"source": label, "row": i}
        )
        for i, t in enumerate(ds[text_field])
    ]


def _is_network_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed connection, whichever HTTP stack raised it."""
    seen = 0
    while exc is not None and seen < 10:
        module = type(exc).__module__.split(".")[0]
        if isinstance(exc, (ConnectionError, TimeoutError)) or module in _NETWORK_MODULES:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
