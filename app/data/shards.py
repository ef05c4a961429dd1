"""Token shard format: a 256-byte header, then the tokens as little-endian uint16 or uint32.

Header: magic b"PRETRAIN", format version (u32), bytes per token (u32: 2 or 4), token count (u64),
zero padding. The count in the header is checked against the file size, so a truncated shard is
detected without reading it. Shards are streamed to a hidden `.NAME.partial` file whose header says 0
tokens, then the header is filled in, fsync'd and renamed: a crash never leaves a partial file under a
final name, and a partial file never passes `read_header`.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.errors import UserError
from app.files import fsync_dir

MAGIC = b"PRETRAIN"
VERSION = 1
HEADER_BYTES = 256
_HEADER = struct.Struct("<8sIIQ")
_CHUNK = 8 << 20
# Files this module may create in a data dir; `remove_stale` deletes only names matching this.
SHARD_NAME = re.compile(r"^(?P<split>train|val)_(?P<index>\d{6})\.bin$")
_TEMP_NAME = re.compile(r"^\.(train|val)_\d{6}\.bin\.(partial|tmp-\d+)$")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _header(itemsize: int, count: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, itemsize, count).ljust(HEADER_BYTES, b"\0")


class ShardWriter:
    """Streams one shard to its hidden partial file (flat memory however large), hashing the token bytes."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        if np.dtype(dtype) not in (np.uint16, np.uint32):
            raise ValueError(f"shard tokens must be uint16 or uint32, got {dtype}")
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        self.count = 0
        self._hash = hashlib.sha256()
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        self._f.write(_header(self.dtype.itemsize, 0))

    def write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._f.write(data)
        self._hash.update(data)
        self.count += int(tokens.size)

    def finish(self) -> tuple[int, str]:
        """Fill in the header, fsync, rename to the final name. Returns (tokens, sha256 of the token bytes)."""
        self._f.seek(0)
        self._f.write(_header(self.dtype.itemsize, self.count))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.count, self._hash.hexdigest()

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


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
    dtype, count = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses empty files
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=HEADER_BYTES, shape=(count,))


def payload_sha256(path: Path) -> str:
    """sha256 of a shard's token bytes (what the manifest records), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_shard(path: Path, dtype: np.dtype, tokens: int, sha256: str = "") -> str:
    """'' when the shard is complete and matches; else why not (one short phrase)."""
    try:
        got_dtype, count = read_header(path)
    except UserError as e:
        return str(e)
    if got_dtype != np.dtype(dtype):
        return f"{path.name} holds {got_dtype.name}, expected {np.dtype(dtype).name}"
    if count != tokens:
        return f"{path.name} has {count} tokens, expected {tokens}"
    if sha256 and payload_sha256(path) != sha256:
        return f"{path.name} does not match its sha256"
    return ""


def remove_stale(directory: Path, keep: set[str]) -> list[str]:
    """Delete shard files and temp files of an earlier run that are not in `keep`; returns their names."""
    removed = []
    for p in sorted(Path(directory).iterdir()):
        if (SHARD_NAME.match(p.name) and p.name not in keep) or _TEMP_NAME.match(p.name):
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


@dataclass
class ShardInfo:
    """One shard in the manifest.

    documents: documents whose last token (the boundary token) is in this shard; bytes: their UTF-8
    bytes (for bits per byte); sha256: of the token bytes after the header; start/end: stream positions
    [document index, token offset] of the first token and just after the last one (what resume uses).
    """

    file: str
    tokens: int
    documents: int
    bytes: int
    sha256: str = ""
    start: list[int] = field(default_factory=lambda: [0, 0])
    end: list[int] = field(default_factory=lambda: [0, 0])


class SplitWriter:
    """Cuts one split's token stream into shards of exactly `shard_tokens` tokens (the last one shorter),
    continuing after the shards `kept` from an earlier run; `on_shard` runs after each finished shard."""

    def __init__(
        self,
        out: Path,
        split: str,
        shard_tokens: int,
        dtype: np.dtype,
        kept: list[ShardInfo],
        on_shard: Callable[[], None],
    ) -> None:
        self.out, self.split, self.S, self.dtype = out, split, shard_tokens, dtype
        self.shards = list(kept)
        # the stream position after the last kept shard: [document index, token offset into it]
        self.resume_doc, self.resume_offset = kept[-1].end if kept else (0, 0)
        self.on_shard = on_shard
        self.cur: ShardWriter | None = None
        self.cur_start: list[int] = [0, 0]
        self.cur_docs = self.cur_bytes = 0
        self.next_doc = self.resume_doc  # index after the last document seen (for the tail shard's end)
        self.new_tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, nbytes: np.ndarray, docs: np.ndarray) -> None:
        """Documents `docs` (indices, increasing) with their tokens, in stream order."""
        skip = 0
        if self.resume_offset and docs[0] == self.resume_doc:
            skip, self.resume_offset = self.resume_offset, 0  # this document's head is in the last kept shard
            tokens = tokens[skip:]
        ends = np.cumsum(lengths) - skip  # end of each document within `tokens`
        starts = ends - lengths
        n, pos = int(tokens.size), 0
        self.next_doc = int(docs[-1]) + 1
        while pos < n:
            lo = int(np.searchsorted(ends, pos, side="right"))  # the document holding token `pos`
            if self.cur is None:
                self.cur_start = (
                    list(self.shards[-1].end) if self.shards else [int(docs[lo]), int(pos - starts[lo])]
                )
                self.cur = ShardWriter(self.out / shard_name(self.split, len(self.shards)), self.dtype)
            take = min(self.S - self.cur.count, n - pos)
            self.cur.write(tokens[pos : pos + take])
            pos += take
            hi = int(np.searchsorted(ends, pos, side="right"))  # the document holding the next token
            self.cur_docs += hi - lo
            self.cur_bytes += int(nbytes[lo:hi].sum())
            self.new_tokens += take
            if self.cur.count == self.S:
                if hi == len(ends) or pos == starts[hi]:  # at a document boundary: the next document
                    end = [int(docs[hi - 1]) + 1, 0]
                else:
                    end = [int(docs[hi]), int(pos - starts[hi])]
                self._finish(end)

    def _finish(self, end: list[int]) -> None:
        assert self.cur is not None
        count, sha = self.cur.finish()
        self.shards.append(
            ShardInfo(self.cur.path.name, count, self.cur_docs, self.cur_bytes, sha, self.cur_start, end)
        )
        self.cur, self.cur_docs, self.cur_bytes = None, 0, 0
        self.on_shard()

    def close(self) -> None:
        """Write the last, shorter shard."""
        if self.cur is not None and self.cur.count:
            self._finish([self.next_doc, 0])

    def abort(self) -> None:
        if self.cur is not None:
            self.cur.abort()
            self.cur = None
