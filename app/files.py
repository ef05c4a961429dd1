"""Durable file writes shared by every part: atomic JSON, fsync of files and directories, sha256, and the
check that an output directory can be written (one line naming the uid and the fix, not a traceback).

Atomic means temp file + fsync + rename in the same directory: a reader (or a crash) sees the old or
the new content, never half of it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from app.errors import UserError

# errno values that mean "this user may not write here", as opposed to a bug
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable; some filesystems cannot, the rename stays atomic."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_json(path: Path, data: Any, durable: bool = True, indent: int | None = None) -> None:
    """Write JSON atomically; durable also fsyncs the file and the directory (ledgers, manifests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, sort_keys=indent is None, indent=indent, allow_nan=False) + "\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def cut_torn_line(path: Path) -> Path:
    """Drop a last line that a kill cut short, so the next append starts a line of its own instead of
    being glued to it (JSONL logs; read once at start); returns `path`."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
    return path


def create_exclusive(path: Path, text: str, durable: bool = False) -> bool:
    """Create `path` holding `text` unless it exists (O_EXCL: one of several racing creators wins, also on
    NFS v3+); False when it was there. The primitive of the lock files (lease.json, the retry state's)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return True


def read_lock_file(path: Path) -> dict | None:
    """A lock file's JSON object: None when there is none, {} while it cannot be parsed (being written)."""
    try:
        raw = Path(path).read_text()
    except FileNotFoundError:
        return None
    with contextlib.suppress(ValueError):
        if isinstance(data := json.loads(raw), dict):
            return data
    return {}


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def unwritable_message(path: Path | str, what: str, reason: str) -> str:
    """One line: the path, the uid/gid this process runs as, and the ownership fix for a volume; or, when
    one of its parents is a file (nothing can be made under it, whoever owns it), that and another path."""
    if path and (blocker := not_a_directory(Path(path).parent)) is not None:
        return not_a_directory_message(Path(path), what, blocker)
    uid, gid = os.getuid(), os.getgid()
    return (
        f"{what} {path}".strip()
        + f" is not writable by uid {uid} (gid {gid}): {reason}; give this user write access: "
        f"in Kubernetes set the pod's securityContext.fsGroup to {gid} (the chart's podSecurityContext "
        f"does) so the volume is group-writable, or `chown -R {uid}:{gid}` the directory"
    )


def not_a_directory(path: Path) -> Path | None:
    """`path`, or its nearest existing ancestor, when that is not a directory (a file is in the way)."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            return None  # a dangling link: not a file in the way
        if p.exists():
            return None if p.is_dir() else p
    return None


def not_a_directory_message(path: Path, what: str, blocker: Path) -> str:
    """One line for an output path that is (or lies under) a file: permissions are not the problem."""
    kind = "a file, not a directory" if blocker.is_file() else "not a directory"
    where = f"{what} {path}".strip()
    head = f"{where} is {kind}" if blocker == path else f"{where}: {blocker} is {kind}"
    other = what if what.startswith("--") and " " not in what else "path"
    return f"{head}; pick another {other}"


def check_writable_dir(path: Path | str, what: str = "--out", create: bool = True) -> None:
    """Create `path` if needed and prove a file can be made in it (a real probe: permission bits do not
    tell about root-squashed NFS, read-only mounts or ACLs); UserError (exit 2) with the fix if not:
    ownership for a volume this user may not write, another path when a file is in the way. Without
    `create` (a dry run), the probe goes into the nearest directory that exists."""
    path = Path(path)
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        probe_dir = next(p for p in (path, *path.parents) if p.exists() or create)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTDIR) and (blocker := not_a_directory(path)) is not None:
            raise UserError(not_a_directory_message(path, what, blocker)) from None
        where = f" ({e.filename})" if e.filename and Path(e.filename) != path else ""
        raise UserError(unwritable_message(path, what, f"{e.strerror or e}{where}")) from None


def stop_file_of(path: Path | str | None, run_dir: Path | str) -> Path:
    """The stop file the watcher writes and the trainer polls: --stop-file `path`, else RUN_DIR/stop.json.
    Both read it from here, so the two always agree on where a stop goes."""
    return Path(path) if path else Path(run_dir) / "stop.json"


def not_a_stop_file(stop_file: Path) -> str | None:
    """What `stop_file` is when it cannot carry a stop ("a directory", or a device, FIFO or socket: the
    trainer would read it as a stop request at once, the watcher could not write one onto it) and how to
    name one instead; None if it can (a regular file, or none yet)."""
    if stop_file.is_dir():
        return f"a directory: name a file in it, e.g. --stop-file {stop_file / 'stop.json'}"
    if stop_file.exists() and not stop_file.is_file():
        return "not a regular file (a device, a FIFO or a socket): name a regular file"
    return None
