"""The corpus-spec grammar: what a ``data.corpus`` / ``--corpus`` string names, parsed and checked
without reading any text (and without importing torch: the command line checks a spec here before
anything heavy loads). :mod:`.sources` reads the text a spec names; its docstring describes each form.

* a built-in name (``sotu``, ``moby-dick``, ``emails``, ``kjv``, ``pydoc``), a ``.txt`` / ``.jsonl`` /
  ``.parquet`` file or a folder of them, ``hf:<dataset>[:<config>][:<split>]``; any of them may end
  in ``?field=<name>`` (:func:`parse_spec`, :func:`parse_hf_spec`, :func:`row_slice`);
* ``generated:<n_tokens>[:<prompt corpus>][?option=value&…]``: text the teacher samples
  (:func:`parse_generated_spec`); ``chat:<prompt corpus>[:<n>]``: its answers (:func:`parse_chat_spec`);
* ``recall:<n>[:<prose corpus>][?max_words=N&seed=S]``: recall passages (:mod:`.recall`); ``mix:<name>``: a built-in mixture (:data:`MIXTURES`);
* ``shards:<folder>``: token ids written once (:mod:`.shards`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from attn2ssm.errors import DataError

from . import builtin


def is_shards(spec) -> bool:
    """Whether ``spec`` names a token shard folder (``shards:DIR``)."""
    return isinstance(spec, str) and spec.startswith(SHARDS_PREFIX)


FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")


DEFAULT_TEXT_FIELD = "text"


_SPLIT_NAMES = {"train", "validation", "valid", "test", "dev", "all"}


GENERATED_PREFIX = "generated:"


def parse_spec(spec: str, text_field: str | None = None) -> tuple[str, str]:
    """Split ``"base?field=x"`` into ``(base, text_field)``; a conflicting argument is an error."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(
            "no corpus given",
            "set data.corpus to a built-in name, a file, a directory or hf:<dataset>",
        )
    spec = spec.strip()
    if is_recall(spec):  # its own options (parse_recall_spec)
        return spec, text_field or DEFAULT_TEXT_FIELD
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


@dataclass(frozen=True)
class GeneratedSpec:
    """A parsed ``generated:`` spec (see the module docstring)."""

    n_tokens: int
    prompts: str | None = None  # corpus the prompts are cut from; None: start from BOS
    temperature: float = 1.0
    top_p: float = 1.0
    length: int = 256  # new tokens per sample
    prompt_len: int = 16
    batch: int = 16
    field: str | None = None
    given: frozenset = frozenset()  # the options the spec set itself (a batch not given is chosen per device)


_GENERATED_OPTIONS = {
    "temperature": float,
    "top_p": float,
    "length": int,
    "prompt_len": int,
    "batch": int,
    "field": str,
}


_GENERATED_FORM = "write generated:<n_tokens>[:<prompt corpus>][?temperature=1&top_p=0.95&length=256&prompt_len=16&batch=16]"


def is_generated(spec) -> bool:
    return isinstance(spec, str) and spec.strip().startswith(GENERATED_PREFIX)


CHAT_PREFIX = "chat:"  # the teacher's chat-formatted answers, as a corpus (data/teacher_samples.py)


def is_chat(spec) -> bool:
    return isinstance(spec, str) and spec.strip().startswith(CHAT_PREFIX)


def parse_chat_spec(spec: str) -> tuple[str, int]:
    """``chat:<prompt corpus>[:<n>]`` → (prompt corpus, n answers; default 64)."""
    rest = spec.strip()[len(CHAT_PREFIX) :]
    corpus, sep, n = rest.rpartition(":")
    if not sep or not n.isdigit():
        corpus, n = rest, "64"
    if not corpus or int(n) < 1 or needs_teacher(corpus) or is_mixture(corpus) or is_recall(corpus):
        raise DataError(
            f"bad chat corpus spec {spec!r}",
            "write chat:<prompt corpus>[:<answers>], e.g. chat:sotu:64 (a corpus of prose)",
        )
    return corpus, int(n)


def needs_teacher(spec) -> bool:
    """Whether ``spec`` is text the teacher writes (``generated:``, ``chat:``)."""
    return is_generated(spec) or is_chat(spec)


MIX_PREFIX = "mix:"


# Built-in mixtures of training text: (corpus spec, weight) per source. None of them holds an
# evaluation corpus (emails, kjv, pydoc) or held-out text: sotu and moby-dick train on their training
# splits, recall passages are cut from sotu's training addresses, generated text and chat answers are
# the teacher's own (their prompts come from sotu's training passages, never from an evaluation task).
MIXTURES = {
    # no teacher sampling: quick to prepare (the demo's)
    "corpora": (("sotu", 0.6), ("moby-dick", 0.3), ("recall:512:sotu", 0.1)),
    # the built-in recipes': + 8,192 tokens the teacher samples from BOS and its answers to 32 instructions
    "general": (
        ("sotu", 0.4),
        ("moby-dick", 0.25),
        ("recall:512:sotu", 0.1),
        ("generated:8192?top_p=0.95", 0.15),
        ("chat:sotu:32", 0.1),
    ),
}


def is_mixture(spec) -> bool:
    return isinstance(spec, str) and spec.strip().startswith(MIX_PREFIX)


def expand_mixture(spec: str) -> tuple[tuple[str, float], ...]:
    """``mix:<name>`` → its (corpus spec, weight) sources; an unknown name is a DataError."""
    name = spec.strip()[len(MIX_PREFIX) :]
    if name not in MIXTURES:
        raise DataError(
            f"no built-in mixture {name!r}",
            f"use one of: {', '.join(MIX_PREFIX + n for n in MIXTURES)}, or list data.sources",
        )
    return MIXTURES[name]


def parse_generated_spec(spec: str) -> GeneratedSpec:
    """``"generated:<n_tokens>[:<prompt corpus>][?k=v&…]"`` → :class:`GeneratedSpec`; bad parts are DataErrors."""
    rest = spec.strip()[len(GENERATED_PREFIX) :]
    rest, _, query = rest.partition("?")
    count, _, prompts = rest.partition(":")
    try:
        n_tokens = int(count)
    except ValueError:
        raise DataError(f"{spec!r} does not start with a number of tokens", _GENERATED_FORM) from None
    options: dict = {}
    for pair in filter(None, query.split("&")):
        key, _, value = pair.partition("=")
        if key not in _GENERATED_OPTIONS or not value:
            raise DataError(
                f"unknown option {pair!r} in {spec!r}", f"options: {', '.join(_GENERATED_OPTIONS)}"
            )
        try:
            options[key] = _GENERATED_OPTIONS[key](value)
        except ValueError:
            raise DataError(
                f"option {key}={value!r} in {spec!r} is not a {_GENERATED_OPTIONS[key].__name__}",
                _GENERATED_FORM,
            ) from None
    g = GeneratedSpec(n_tokens, prompts or None, **options, given=frozenset(options))
    for name, ok in (
        ("n_tokens", g.n_tokens >= 1),
        ("temperature", g.temperature > 0),
        ("top_p", 0 < g.top_p <= 1),
        ("length", g.length >= 1),
        ("prompt_len", g.prompt_len >= 1),
        ("batch", g.batch >= 1),
    ):
        if not ok:
            raise DataError(
                f"{name}={getattr(g, name)} in {spec!r} is out of range",
                "n_tokens, length, prompt_len and batch are positive; temperature > 0; 0 < top_p <= 1",
            )
    if g.field is not None and g.prompts is None:
        raise DataError(
            f"{spec!r} sets field= but has no prompt corpus",
            "name the corpus: generated:<n_tokens>:<corpus>?field=NAME",
        )
    return g


SHARDS_PREFIX = "shards:"  # a token shard folder (data/shards.py)


def check_spec(spec: str) -> None:
    """Refuse, without reading any text (and without importing torch), a spec that cannot name a
    corpus: a ``generated:`` spec that does not parse, a malformed ``hf:`` spec, a ``shards:`` folder
    without a manifest, a local path that does not exist or is a file of another format."""
    if is_generated(spec):
        parse_generated_spec(spec)
        return
    if is_mixture(spec):
        for source, _ in expand_mixture(spec):
            check_spec(source)
        return
    if is_chat(spec):
        check_spec(parse_chat_spec(spec)[0])
        return
    if is_recall(spec):
        check_spec(parse_recall_spec(spec)[1])
        return
    base, _ = parse_spec(spec)
    if base.startswith(SHARDS_PREFIX):
        folder = Path(base[len(SHARDS_PREFIX) :]).expanduser()
        if not (folder / "manifest.json").is_file():
            raise DataError(
                f"{folder} holds no token shards (manifest.json missing)",
                "write them with 'attn2ssm data shards', or check the path",
            )
        return
    if builtin.is_builtin(base):
        return
    if base.startswith("hf:"):
        parse_hf_spec(base[3:])
        return
    root = Path(base).expanduser()
    if not root.exists():
        raise DataError(
            f"corpus path {str(root)!r} does not exist",
            "check the path, or use a built-in corpus (sotu, moby-dick), hf:<dataset> or shards:<folder>",
        )
    if root.is_file() and not root.name.endswith(FILE_SUFFIXES):
        raise DataError(
            f"cannot read corpus file {str(root)!r}: unsupported format",
            f"use one of {', '.join(FILE_SUFFIXES)} or a directory of such files",
        )
    if root.is_dir() and not local_files(root):
        no_text_files(root)


def no_text_files(root: Path):
    if (root / "manifest.json").is_file():  # a token shard folder named without its prefix
        raise DataError(
            f"directory {str(root)!r} holds token shards, not text files", f"name it shards:{root}"
        )
    raise DataError(
        f"directory {str(root)!r} holds no {', '.join(FILE_SUFFIXES)} files",
        "point data.corpus at a folder with text files",
    )


def local_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.endswith(FILE_SUFFIXES):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def parse_hf_spec(rest: str) -> tuple[str, str | None, str]:
    """``"name[:config][:split]"`` → ``(name, config, split)``; see the module docstring."""
    parts = re.split(r":(?![^\[]*\])", rest)  # a ':' inside a slice like train[:100] is not a separator
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise DataError(f"bad hub corpus spec 'hf:{rest}'", "write hf:<dataset>[:<config>][:<split>]")
    name, config, split = parts[0], None, "train"
    if len(parts) == 3:
        config, split = parts[1], parts[2]
    elif len(parts) == 2:
        if parts[1].split("[")[0] in _SPLIT_NAMES or "[" in parts[1]:
            split = parts[1]
        else:
            config = parts[1]
    return name, config, split


_ROW_SLICE = re.compile(r"^(?P<name>[^\[\]]+?)(?:\[(?P<start>\d*):(?P<stop>\d*)\])?$")


def row_slice(split: str) -> tuple[str, int, int | None] | None:
    """``"train"`` → ``("train", 0, None)``, ``"train[10:20]"`` → ``("train", 10, 20)``; ``None`` for a
    split only ``datasets`` itself can cut (percentages, negative or single indices), which is downloaded."""
    m = _ROW_SLICE.match(split)
    if m is None:
        return None
    start = int(m["start"]) if m["start"] else 0
    stop = int(m["stop"]) if m["stop"] else None
    return m["name"], start, stop


def can_stream(spec: str) -> bool:
    """Whether ``spec`` is a hub corpus that :func:`iter_hf_documents` can read row by row."""
    base, _ = parse_spec(spec)
    return base.startswith("hf:") and row_slice(parse_hf_spec(base[3:])[2]) is not None


# ------------------------------------------------------------------------------ recall passages

RECALL_PREFIX = "recall:"  # key-value recall passages (data/recall.py)
DEFAULT_PROSE = "sotu"
DEFAULT_MAX_WORDS = 600
MIN_WORDS = 40


def is_recall(spec: str) -> bool:
    return isinstance(spec, str) and spec.strip().startswith(RECALL_PREFIX)


def parse_recall_spec(spec: str) -> tuple[int, str, int, int]:
    """``recall:<n>[:<prose corpus>][?max_words=N&seed=S]`` → (n, prose corpus, max_words, seed)."""
    body = spec.strip()[len(RECALL_PREFIX) :]
    options = {"max_words": DEFAULT_MAX_WORDS, "seed": 0}
    body, sep, query = body.partition("?")
    for pair in query.split("&") if sep else ():
        key, _, value = pair.partition("=")
        if key not in options or not value.isdigit() or (key == "max_words" and int(value) < MIN_WORDS):
            raise DataError(
                f"bad option {pair!r} in {spec!r}",
                f"the options are ?max_words=N (N >= {MIN_WORDS}) and &seed=S (S >= 0)",
            )
        options[key] = int(value)
    count, _, prose = body.partition(":")
    if not count.isdigit() or int(count) < 1:
        raise DataError(
            f"bad recall corpus spec {spec!r}",
            "write recall:<passages>[:<prose corpus>], e.g. recall:256:sotu",
        )
    prose = prose or DEFAULT_PROSE
    if is_recall(prose):
        raise DataError(
            f"{spec!r}: a recall corpus cannot take its prose from another recall corpus",
            "name a prose corpus, e.g. recall:256:sotu",
        )
    return int(count), prose, options["max_words"], options["seed"]
