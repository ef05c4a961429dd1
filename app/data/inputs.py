"""Input files of `pretrain prepare`: what they are (SourceFile), their format from the name, and the
local listing (a file, a directory or a glob). Hub listings are in app.data.hub."""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from pathlib import Path

from app.errors import UserError

_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_FORMATS = {
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "txt",
    ".text": "txt",
    ".md": "txt",
}
SUPPORTED = ".parquet, .jsonl/.json/.ndjson and .txt/.md (text formats optionally .gz or .zst)"


@dataclass(frozen=True)
class SourceFile:
    """One input file; `name` and `fingerprint` let a re-run tell whether it changed."""

    name: str  # path relative to its input (local), or the path in the repo (hub)
    size: int
    fingerprint: str
    format: str  # parquet | jsonl | txt
    compression: str = ""  # "" | gzip | zstd
    local_path: str = ""  # "" for a hub file until it is downloaded
    repo: str = ""  # hub dataset repo id
    commit: str = ""  # hub commit sha the listing came from

    @property
    def label(self) -> str:
        """How messages and the manifest name this file."""
        return f"hf://datasets/{self.repo}/{self.name}" if self.repo else (self.local_path or self.name)


def file_format(name: str) -> tuple[str, str] | None:
    """(format, compression) from the file name, or None when it is not a supported input."""
    p = Path(name.lower())
    compression = _COMPRESSION.get(p.suffix, "")
    if compression:
        p = p.with_suffix("")
    fmt = _FORMATS.get(p.suffix)
    if fmt is None or (fmt == "parquet" and compression):
        return None
    return fmt, compression


def _quick_fingerprint(path: Path, size: int) -> str:
    """Size plus a hash of the first and last 64 KiB: survives copies, notices almost any rewrite."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        if size > 1 << 17:
            f.seek(size - (1 << 16))
        h.update(f.read(1 << 16))
    return f"{size}:{h.hexdigest()[:16]}"


def _local_file(path: Path, name: str) -> SourceFile:
    fmt = file_format(path.name)
    if fmt is None:
        raise UserError(f"cannot tell the format of {path}: supported are {SUPPORTED}")
    try:
        size = path.stat().st_size
        fingerprint = _quick_fingerprint(path, size)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    return SourceFile(name, size, fingerprint, fmt[0], fmt[1], local_path=str(path))


def list_local(spec: str) -> list[SourceFile]:
    """A file, a directory (searched recursively, hidden entries skipped) or a glob pattern."""
    if any(c in spec for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        files = [p for p in paths if file_format(p.name)]
        if not files:
            raise UserError(f"no input files match {spec} (supported: {SUPPORTED})")
        root = Path(spec.split("*")[0].split("?")[0].split("[")[0])
        root = root if root.is_dir() else root.parent
        return [_local_file(p, str(p.relative_to(root)) if p.is_relative_to(root) else p.name) for p in files]
    path = Path(spec)
    if path.is_file():
        return [_local_file(path, path.name)]
    if not path.exists():
        raise UserError(f"input {spec} does not exist")
    if not path.is_dir():
        raise UserError(f"input {spec} is neither a file nor a directory")
    found: list[Path] = []
    others: set[str] = set()
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        (found.append(p) if file_format(p.name) else others.add(p.suffix or p.name))
    if not found:
        what = f" (found only {', '.join(sorted(others)[:8])})" if others else " (it is empty)"
        raise UserError(f"no input files in {spec}{what}; supported are {SUPPORTED}")
    return [_local_file(p, str(p.relative_to(path))) for p in found]
