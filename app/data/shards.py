"""Token shard format: a 256-byte header, then the tokens as little-endian uint16 or uint32.

Header: magic b"PRETRAIN", format version (u32), bytes per token (u32: 2 or 4), token count (u64),
zero padding. The count in the header is checked against the file size, so a truncated shard is
detected without reading it. Shards are written to a temp name and renamed: a crash never leaves a
partial file under a final name.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from app.errors import UserError

MAGIC = b"PRETRAIN"
VERSION = 1
HEADER_BYTES = 256
_HEADER = struct.Struct("<8sIIQ")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(path: Path, tokens: np.ndarray) -> int:
    """Write atomically (temp file, fsync, rename). Returns the file size in bytes."""
    path = Path(path)
    if tokens.dtype not in (np.uint16, np.uint32):
        raise ValueError(f"shard tokens must be uint16 or uint32, got {tokens.dtype}")
    header = _HEADER.pack(MAGIC, VERSION, tokens.dtype.itemsize, int(tokens.size)).ljust(HEADER_BYTES, b"\0")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(np.ascontiguousarray(tokens, dtype=tokens.dtype.newbyteorder("<")).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return HEADER_BYTES + tokens.nbytes


def read_header(path: Path) -> tuple[np.dtype, int]:
    """(dtype, token count); raises UserError for a file that is not a complete shard."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
        size = path.stat().st_size
    except OSError as e:
        raise UserError(f"cannot read shard {path}: {e.strerror}") from None
    if len(raw) < _HEADER.size:
        raise UserError(f"shard {path} is truncated (no header); re-run `pretrain prepare`")
    magic, version, itemsize, count = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise UserError(f"{path} is not a pretrain token shard (bad magic); re-run `pretrain prepare`")
    if version != VERSION:
        raise UserError(f"shard {path} has format version {version}, this build reads {VERSION}")
    if itemsize not in (2, 4):
        raise UserError(f"shard {path} has an invalid token width {itemsize}")
    if size != HEADER_BYTES + itemsize * count:
        raise UserError(
            f"shard {path} is truncated: header says {count} tokens, file has "
            f"{max(0, size - HEADER_BYTES) // itemsize}; re-run `pretrain prepare`"
        )
    return np.dtype(np.uint16 if itemsize == 2 else np.uint32), count


def open_shard(path: Path) -> np.memmap:
    """Memory-map a shard's tokens (read-only)."""
    dtype, count = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses empty files
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=HEADER_BYTES, shape=(count,))
