"""The sharded checkpoint format: every rank writes its own safetensors files, a JSON index says which
box of which tensor lies in which file. No pickle; a checkpoint written at any world size reads at any
other, and in one process.

    model-rank00000.safetensors       rank 0's pieces of the weights (a piece: one box of one tensor)
    optimizer-rank00000.safetensors   rank 0's pieces of the optimizer state, keyed "<param name>/<state>"
    model.index.json                  {"tensors": {name: {"dtype", "shape", "chunks": [chunk, ...]}},
                                       "tied": {alias: name}}
    optimizer.index.json              the same for "<param name>/<state>", plus "param_groups" (parameters
                                       by name) and "scalars" (non-tensor state)

    chunk = {"file": "model-rank00001.safetensors", "key": "tok_emb.weight",
             "offsets": [4096, 0], "shape": [4096, 768]}     (where the box starts, and its size)

The writer streams each tensor from memory to disk in BLOCK pieces and hashes them on the way, on a
second thread that the writer never waits for (no serialized copy, no second read for the sha256, and the
hash overlaps the final fsync; see benchmarks/bench_checkpoint.py). The reader fills any box of a tensor
from the chunks that overlap it, reading only those bytes, so a rank never holds more of a tensor than the
box it asked for; a box that is whole rows of a stored tensor (every shard and whole tensor here) is read
with one pread straight into its destination, with no intermediate copy and no mapping of the file into
the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MODEL_INDEX = "model.index.json"
OPTIMIZER_INDEX = "optimizer.index.json"
BLOCK = 4 << 20  # bytes per write() and per hash update (16 and 64 MB measured slower: bench_checkpoint)

# torch dtype <-> safetensors dtype tag; the index stores torch's name ("float32")
_TAGS = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_TAG = {tag: dt for dt, tag in _TAGS.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint index")
    return dt


def shard_file(kind: str, rank: int) -> str:
    """kind: model | optimizer."""
    return f"{kind}-rank{rank:05d}.safetensors"


@dataclass
class FileEntry:
    sha256: str
    bytes: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "bytes": self.bytes}


# ---------------------------------------------------------------- writing


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class _HashingFile:
    """A file written block by block while a second thread hashes the same blocks (hashlib releases the
    GIL), so the sha256 costs no extra pass over the data. The writer never waits for the hash: the blocks
    are views of tensors the caller holds, so a hash that lags costs no memory, and its backlog is worked
    off during the final fsync, which then overlaps the hashing instead of following it (with the writer
    held within 8 blocks of the hash, one writer reached 60% of a plain write here, unheld 85%, the
    sha256's own speed: benchmarks/bench_checkpoint.py). `drain()` waits for the hash to catch up: after
    a tensor whose bytes were a private copy (a device or non-contiguous tensor), so only one such copy
    is ever alive."""

    def __init__(self, path: Path, pool: ThreadPoolExecutor, cancel: Callable[[], None] | None) -> None:
        self.f = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.h = hashlib.sha256()
        self.pool = pool
        self.cancel = cancel
        self.pending: deque[Future] = deque()
        self.n = 0

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        for i in range(0, len(view), BLOCK):
            if self.cancel is not None:
                self.cancel()  # raises to abandon the write
            block = view[i : i + BLOCK]
            self.pending.append(self.pool.submit(self.h.update, block))  # one worker: updates in order
            self.f.write(block)
            while self.pending and self.pending[0].done():
                self.pending.popleft().result()
        self.n += len(view)

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> FileEntry:
        self.f.flush()
        os.fsync(self.f.fileno())  # the hash thread works off its backlog meanwhile
        self.f.close()
        self.drain()
        return FileEntry(self.h.hexdigest(), self.n)

    def abort(self) -> None:
        self.f.close()
        for fut in self.pending:
            fut.cancel()  # the hash of an abandoned file is not needed: only a running update is waited for
        for fut in self.pending:
            if not fut.cancelled():
                with contextlib.suppress(Exception):
                    fut.result()
        self.pending.clear()


def _header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for key, dtype, shape in specs:
        if dtype not in _TAGS:
            raise ValueError(f"cannot store {key} of dtype {dtype} in safetensors")
        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _TAGS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format wants the data 8-byte aligned
    return struct.pack("<Q", len(head)) + head


def _stream(
    path: Path,
    head: bytes,
    tensors: Iterable[torch.Tensor],
    cancel: Callable[[], None] | None = None,
    transient: bool = False,
) -> FileEntry:
    """`transient`: the tensors are made for this write (nobody else holds them), so each one's hash must
    finish before the next is made, or they would all stay alive."""
    with ThreadPoolExecutor(1, thread_name_prefix="sha256") as pool:
        out = _HashingFile(Path(path), pool, cancel)
        try:
            out.write(head)
            for t in tensors:
                out.write(_raw(t))
                if transient or t.device.type != "cpu" or not t.is_contiguous():  # _raw made a copy
                    out.drain()
        except BaseException:
            out.abort()
            raise
        return out.close()


def write_safetensors(
    path: Path,
    items: list[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
    cancel: Callable[[], None] | None = None,
) -> FileEntry:
    """A safetensors file streamed from `items` one tensor at a time (CUDA tensors are copied to the host
    one at a time); fsync'd; returns its sha256 and size. `cancel` is called between blocks and may raise
    to abandon the write."""
    head = _header([(k, t.dtype, tuple(t.shape)) for k, t in items], metadata)
    return _stream(path, head, (t for _, t in items), cancel)


def write_json_file(path: Path, data: Any) -> FileEntry:
    """JSON written and fsync'd in place (inside a temp dir that is renamed as a whole)."""
    raw = (json.dumps(data, indent=1) + "\n").encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(hashlib.sha256(raw).hexdigest(), len(raw))


def chunk(file: str, key: str, offsets, shape) -> dict:
    return {"file": file, "key": key, "offsets": [int(o) for o in offsets], "shape": [int(s) for s in shape]}


def merge_chunks(parts: list[dict]) -> dict[str, dict]:
    """Every rank's {name: {"dtype", "shape", "chunks"}} -> one index; checks that the chunks of each
    tensor add up to the whole tensor (they never overlap: FSDP shards and DDP row splits are disjoint)."""
    tensors: dict[str, dict] = {}
    for part in parts:
        for name, entry in part.items():
            have = tensors.setdefault(name, {"dtype": entry["dtype"], "shape": entry["shape"], "chunks": []})
            if have["shape"] != entry["shape"] or have["dtype"] != entry["dtype"]:
                raise ValueError(f"ranks disagree on the shape or dtype of {name}")
            have["chunks"] += entry["chunks"]
    for name, entry in tensors.items():
        total = _numel(entry["shape"])
        got = sum(_numel(c["shape"]) for c in entry["chunks"])
        if got != total:
            raise ValueError(f"the pieces of {name} hold {got} of its {total} elements")
        entry["chunks"].sort(key=lambda c: c["offsets"])
    return dict(sorted(tensors.items()))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ---------------------------------------------------------------- reading


class ShardReader:
    """Reads boxes of the tensors of one index (model or optimizer) of one checkpoint dir."""

    def __init__(self, root: Path, index: dict) -> None:
        self.root = Path(root)
        self.tensors: dict[str, dict] = index["tensors"]
        self.tied: dict[str, str] = index.get("tied", {})
        self.param_groups: list[dict] = index.get("param_groups", [])
        self.scalars: dict[str, dict] = index.get("scalars", {})
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}
        self._plain: dict[str, tuple[int, int, dict]] = {}  # file -> (fd, data start, safetensors header)

    # -- construction from a checkpoint dir

    @classmethod
    def open(cls, root: Path, kind: str) -> ShardReader:
        """kind: model | optimizer."""
        index = Path(root) / (MODEL_INDEX if kind == "model" else OPTIMIZER_INDEX)
        return cls(Path(root), json.loads(index.read_text()))

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()
        self._plain.clear()

    # -- what is there

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return dtype_of(self.tensors[name]["dtype"])

    # -- reading

    def _file(self, name: str):
        if name not in self._open:
            from safetensors import safe_open

            self._open[name] = self._stack.enter_context(safe_open(str(self.root / name), framework="pt"))
        return self._open[name]

    def read(self, name: str, out: torch.Tensor, offsets=None) -> torch.Tensor:
        """Fill `out` with the box of tensor `name` that starts at `offsets` (default: the origin) and has
        out's shape, from the chunks that overlap it; each piece read is at most the overlap's size."""
        entry = self.tensors[name]
        offsets = tuple(offsets or (0,) * out.dim())
        if len(offsets) != len(entry["shape"]) or out.dim() != len(entry["shape"]):
            raise ValueError(f"{name}: a box of rank {out.dim()} asked of a tensor of shape {entry['shape']}")
        filled = 0
        for c in entry["chunks"]:
            lo = [max(o, co) for o, co in zip(offsets, c["offsets"], strict=True)]
            hi = [
                min(o + s, co + cs)
                for o, s, co, cs in zip(offsets, out.shape, c["offsets"], c["shape"], strict=True)
            ]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            dst = out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))]
            if not self._read_into(c, lo, hi, dst):
                src = self._file(c["file"])
                if out.dim() == 0:
                    piece = src.get_tensor(c["key"])
                else:
                    piece = src.get_slice(c["key"])[
                        tuple(slice(a - co, b - co) for a, b, co in zip(lo, hi, c["offsets"], strict=True))
                    ]
                dst.copy_(piece.reshape(dst.shape))
            filled += dst.numel()
        if filled != out.numel():
            raise ValueError(f"{name}: the checkpoint's chunks cover {filled} of the {out.numel()} asked for")
        return out

    def _header_of(self, file: str) -> tuple[int, int, dict]:
        """(fd, where the data starts, header) of a safetensors file, read once per reader."""
        if file not in self._plain:
            f = self._stack.enter_context(open(self.root / file, "rb", buffering=0))  # noqa: SIM115
            (n,) = struct.unpack("<Q", _pread(f.fileno(), 8, 0))
            self._plain[file] = (f.fileno(), 8 + n, json.loads(_pread(f.fileno(), n, 8)))
        return self._plain[file]

    def _read_into(self, c: dict, lo: list[int], hi: list[int], dst: torch.Tensor) -> bool:
        """Read the box [lo, hi) of chunk `c` with one pread straight into `dst`, when that box is one run of
        bytes in the file (rows of the stored tensor, as FSDP and DDP shards and whole tensors are) and
        `dst` is contiguous host memory of the same dtype. No intermediate tensor and no mapping of the
        file into this process (the file's pages never count in its RSS). False: use the general path."""
        if dst.device.type != "cpu" or not dst.is_contiguous() or dst.numel() == 0:
            return False
        fd, start, header = self._header_of(c["file"])
        entry = header.get(c["key"])
        if not isinstance(entry, dict) or _FROM_TAG.get(entry.get("dtype")) != dst.dtype:
            return False
        shape = [int(x) for x in entry["shape"]]
        if shape != [int(x) for x in c["shape"]]:
            return False
        rel_lo = [a - co for a, co in zip(lo, c["offsets"], strict=True)]
        rel_hi = [b - co for b, co in zip(hi, c["offsets"], strict=True)]
        if any(rel_lo[d] != 0 or rel_hi[d] != shape[d] for d in range(1, len(shape))):
            return False  # not whole rows: not one run of bytes
        row = _numel(shape[1:]) * dst.element_size()
        begin, end = (int(x) for x in entry["data_offsets"])
        first = start + begin + (rel_lo[0] * row if shape else 0)
        nbytes = dst.numel() * dst.element_size()
        if end - begin != _numel(shape) * dst.element_size() or first + nbytes > start + end:
            return False
        _pread_into(fd, memoryview(dst.reshape(-1).view(torch.uint8).numpy()).cast("B"), first)
        return True

    def full(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=self.dtype(name), device=device)
        return self.read(name, out)


def _pread(fd: int, n: int, offset: int) -> bytes:
    buf = bytearray(n)
    _pread_into(fd, memoryview(buf), offset)
    return bytes(buf)


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from the file at `offset` (pread returns at most ~2 GiB per call)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise ValueError(f"a checkpoint file ends {len(buf) - done} bytes early")
        done += n


def write_consolidated(
    path: Path, reader: ShardReader, metadata: dict[str, str] | None = None
) -> tuple[FileEntry, int]:
    """One safetensors file with every tensor of `reader` whole (tied aliases are left to the metadata),
    assembled and written one tensor at a time: memory stays at one full tensor. Returns (file, params)."""
    names = reader.names()
    head = _header([(n, reader.dtype(n), reader.shape(n)) for n in names], metadata)
    entry = _stream(path, head, (reader.full(n) for n in names), transient=True)
    return entry, sum(_numel(reader.shape(n)) for n in names)
