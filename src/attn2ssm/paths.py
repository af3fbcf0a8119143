"""Where attn2ssm keeps downloaded teachers, corpora and tokenized blocks, and how it writes outputs
so that a failure or a kill loses nothing already written.

An output is built beside its target in a hidden staging folder (``staging_dir``) whose name ends
in its writer's ``{pid}@{host}``, then moved into place; ``remove_stale_staging`` deletes what a
killed writer left. A run directory is held by one process at a time (``lock_dir``), and so is any
other output (``lock_beside``). A write that fails for want of space or permission becomes a
one-line ``OutputError`` (``writing``), and ``check_writable`` refuses an unwritable output (or a
file where an output folder goes) before anything heavy loads.
"""

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from attn2ssm.errors import Attn2SSMError, OutputError

LOCK = ".lock"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
# .{name}.{purpose}-[random.]{pid}@{host}: staging_dir folders, replace_dir's aside, atomic_write's temporary file
_STAGED = re.compile(r"^\.(?P<name>.+)\.(?P<purpose>[a-z]+)-(?:[^@]*\.)?(?P<pid>\d+)@(?P<host>[^@]+)$")


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


def owner_tag() -> str:
    """``{pid}@{host}``: ends the name of a temporary path, so a later run can tell its writer is gone."""
    return f"{os.getpid()}@{socket.gethostname()}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one (and a
    failed write no temporary file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{owner_tag()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def staging_dir(target: Path, purpose: str) -> Path:
    """A new hidden folder beside ``target`` to build it in: ``.{name}.{purpose}-XXXXXXXX.{pid}@{host}``,
    with the permissions the umask gives a new folder (mkdtemp's are 0700), as it will have in place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(
        tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{purpose}-", suffix=f".{owner_tag()}")
    )
    folder.chmod(0o777 & ~_umask())
    return folder


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give ``folder`` and everything under it the permissions the umask gives new files and
    folders (0755 / 0644 under umask 022; an executable file keeps its x bits): what a writer that
    creates private temporary files (mkdtemp, safetensors' 0600) leaves, made as a plain write's."""
    mask = _umask()
    for path in [Path(folder), *Path(folder).rglob("*")]:
        if path.is_symlink():
            continue
        mode = 0o777 if path.is_dir() or path.stat().st_mode & 0o100 else 0o666
        path.chmod(mode & ~mask)


@contextlib.contextmanager
def staging_beside(target: Path, purpose: str):
    """A ``staging_dir`` for the block, deleted after it (with whatever was not moved out of it)."""
    folder = staging_dir(target, purpose)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def replace_dir(staging: Path, target: Path) -> None:
    """Move directory ``staging`` to ``target`` (same filesystem), replacing a directory there.
    The old one is renamed aside first and deleted only once the new one is in place, so a
    failure leaves the old directory at ``target`` (or, killed between the two renames, beside
    it as ``.<name>.old-<pid>@<host>``, which ``remove_stale_staging`` moves back)."""
    staging, target = Path(staging), Path(target)
    if not target.exists():
        os.replace(staging, target)
        return
    aside = target.with_name(f".{target.name}.old-{owner_tag()}")
    os.replace(target, aside)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


# -- what killed writers leave -------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(folder: Path, *, locked: bool = False) -> list[str]:
    """Delete what killed writers left in ``folder``: entries named by ``staging_dir``,
    ``replace_dir`` or ``atomic_write_bytes`` whose process, on this host, is gone (another host's
    or a live process's are kept), and with ``locked`` (the caller holds ``folder``'s ``lock_dir``,
    so no one else writes there) the trainer's ``.tmp-*`` folders. An output set aside by
    ``replace_dir`` with nothing in its place is moved back instead. Returns the names deleted."""
    folder, removed = Path(folder), []
    if not folder.is_dir():
        return removed
    for path in sorted(folder.iterdir()):
        m = _STAGED.match(path.name)
        if m is None:
            if not (locked and path.name.startswith(".tmp-")):
                continue
        elif m["host"] != socket.gethostname() or _alive(int(m["pid"])):
            continue
        elif m["purpose"] == "old" and not (folder / m["name"]).exists():
            os.replace(path, folder / m["name"])  # killed between replace_dir's two renames
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


# -- run directories: one process at a time --------------------------------------------------------
def lock_dir(folder: Path, then: str = "run the command again"):
    """Hold ``folder`` (created if missing) for this process: an exclusive advisory lock (flock) on
    ``folder/.lock`` for as long as the returned file stays open. The OS drops it when the process
    dies, so a killed run never leaves a stale lock. Held elsewhere: OutputError naming the holder."""
    folder = Path(folder)
    return _hold(folder / LOCK, folder, then)


@contextlib.contextmanager
def lock_beside(target: Path, then: str = "run the command again"):
    """Hold output ``target`` (a file or a folder, existing or not) for the block: ``lock_dir``'s
    flock on ``.{name}.lock`` beside it, so two commands writing one output at once cannot both
    write it (the second is refused in one line). The lock file is deleted, still held, at the end."""
    target = Path(target)
    lock = target.parent / f".{target.name}{LOCK}"
    fh = _hold(lock, target, then)
    try:
        yield
    finally:
        if fh is not None:
            lock.unlink(missing_ok=True)
            fh.close()


def _hold(lock: Path, held: Path, then: str):
    """An exclusive flock on file ``lock`` (made with its folder if missing; the holder written in
    it), the open file holding it; None where there is no flock. Held elsewhere: OutputError."""
    try:
        import fcntl  # optional: POSIX only
    except ImportError:  # no flock (Windows): unlocked, as before
        return None
    while True:
        with writing(held, "its lock file", then):
            lock.parent.mkdir(parents=True, exist_ok=True)
            fh = open(lock, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip()
            fh.close()
            raise OutputError(
                f"another process{f' ({holder})' if holder else ''} is using {held}",
                "wait for it to finish or stop it, or choose another --out",
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            return fh  # a filesystem without locks: unlocked, as before
        if _same_file(fh, lock):
            break
        fh.close()  # a lock_beside holder deleted it between our open and flock: take the new one
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    fh.flush()
    return fh


def _same_file(fh, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fh.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


# -- failed writes ---------------------------------------------------------------------------------
def write_failure(exc: BaseException | None, area: Path | None = None) -> OSError | None:
    """The OS error behind ``exc`` if it is a write that failed for want of space (full disk, quota)
    or permission (read-only or denied folder): ``exc`` itself, what it was raised from or during
    (torch.save raises a RuntimeError over the file's OSError), or the errno a safetensors error
    names ("os error 28"). A denied path outside ``area`` (a read, not the output) does not count."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE + _DENIED:
            outside = (
                area is not None
                and exc.filename is not None
                and Path(area).absolute() not in Path(exc.filename).absolute().parents
            )
            return None if exc.errno in _DENIED and outside else exc
        m = re.search(r"os error (\d+)\)", str(exc))
        if m and int(m[1]) in _NO_SPACE + _DENIED:
            return OSError(int(m[1]), os.strerror(int(m[1])))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def writing(target: Path, what: str, then: str, note: str = ""):
    """Turn a write in the block that fails for want of space or permission into a one-line
    OutputError: what could not be written where, the OS's reason (+ ``note``), and the fix (free
    space, or make it writable, then ``then``). Other errors pass through unchanged."""
    try:
        yield
    except Attn2SSMError:
        raise
    except Exception as exc:
        cause = write_failure(exc, Path(target).parent)
        if cause is None:
            raise
        fix = "free space on its disk" if cause.errno in _NO_SPACE else f"make {target} writable"
        raise OutputError(
            f"cannot write {what} to {target}: {cause.strerror}{note}", f"{fix}, then {then}"
        ) from exc


def check_writable(path: Path, *, beside: bool = False, flag: str = "--out", folder: bool = False) -> None:
    """Refuse, before anything heavy loads, an output that cannot be written: the nearest existing
    folder at or above ``path`` (and with ``beside``, an output staged beside ``path``, above its
    parent too) must take new entries, and nothing above ``path`` may be a file; with ``folder``
    (an output folder) neither may ``path``. access(2): root passes except on a read-only file
    system; a write denied later anyway is still one line (``writing``)."""
    path = Path(path)
    for above in path.absolute().parents:
        if above.exists() and not above.is_dir():
            raise OutputError(f"{flag} {path}: {above} is a file, not a folder", f"choose another {flag}")
    if folder and path.exists() and not path.is_dir():
        raise OutputError(
            f"{flag} {path} is a file, not a folder",
            f"choose another {flag} (a new folder, or one this command wrote)",
        )
    for target in [path.parent, path] if beside else [path]:
        nearest = target.absolute()
        while not nearest.is_dir():
            nearest = nearest.parent
        if not os.access(nearest, os.W_OK | os.X_OK):
            reason = (
                "is on a read-only file system"
                if os.statvfs(nearest).f_flag & os.ST_RDONLY
                else "is not writable (permission denied)"
            )
            raise OutputError(
                f"{flag} {path}: {nearest} {reason}", f"choose another {flag}, or make {nearest} writable"
            )
