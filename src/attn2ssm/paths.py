"""Where attn2ssm keeps downloaded teachers, corpora and tokenized blocks."""

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """``$ATTN2SSM_CACHE``, else ``$XDG_CACHE_HOME/attn2ssm``, else ``~/.cache/attn2ssm``."""
    env = os.environ.get("ATTN2SSM_CACHE")
    if env:
        path = Path(env).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "attn2ssm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def replace_dir(staging: Path, target: Path) -> None:
    """Move directory ``staging`` to ``target`` (same filesystem), replacing a directory there.
    The old one is renamed aside first and deleted only once the new one is in place, so a
    failure leaves the old directory at ``target`` (or, killed between the two renames, beside
    it as ``.<name>.old-<pid>``)."""
    staging, target = Path(staging), Path(target)
    if not target.exists():
        os.replace(staging, target)
        return
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.replace(target, aside)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
