"""The sharded checkpoint format: every rank writes its own safetensors files, and a JSON index says
which box of which tensor lies in which file. No pickle, and a checkpoint written at any world size reads
at any other, and in one process. Writes stream and hash each tensor in one pass; reads fill a box from
the chunks that overlap it, so no rank holds more of a tensor than it keeps. The file layout and the
index fields: docs/parallel.md ("Checkpoints: sharded per rank, any world size, in the background").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
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


def shard_file(kind: str, rank: int) -> str:
    """kind: model | optimizer."""
    return f"{kind}-rank{rank:05d}.safetensors"


@dataclass
class FileEntry:
    sha256: str
    bytes: int


# ---------------------------------------------------------------- writing


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in host memory: its own (writable) when it is contiguous on the CPU, else a copy's."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for key, dtype, shape in specs:
        if dtype not in _TAGS:
            raise ValueError(f"cannot store {key} of dtype {dtype} in safetensors")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
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
    """Write `head` then the tensors' bytes block by block while a second thread hashes the same blocks
    (hashlib releases the GIL), so the sha256 costs no extra pass over the data. The writer never waits for
    the hash (the blocks are views of tensors the caller holds): its backlog is worked off during the final
    fsync (held within 8 blocks, one writer reached 60% of a plain write, unheld 85%:
    benchmarks/bench_checkpoint.py). It waits only after a tensor whose bytes were a private copy (made by
    _raw, or `transient`: made for this write), so only one is alive. `cancel` may raise to abandon it."""
    digest = hashlib.sha256()
    pending: deque = deque()  # hash updates submitted, in order

    def drain() -> None:
        while pending:
            pending.popleft().result()

    def write(view: memoryview) -> None:
        for i in range(0, len(view), BLOCK):
            if cancel is not None:
                cancel()  # raises to abandon the write
            block = view[i : i + BLOCK]
            pending.append(pool.submit(digest.update, block))  # one worker: updates in order
            out.write(block)
            while pending and pending[0].done():
                pending.popleft().result()

    with ThreadPoolExecutor(1, thread_name_prefix="sha256") as pool, open(path, "wb") as out:
        try:
            write(memoryview(head))
            for tensor in tensors:
                write(_raw(tensor))
                if transient or tensor.device.type != "cpu" or not tensor.is_contiguous():  # _raw made a copy
                    drain()
            size = out.tell()
            out.flush()
            os.fsync(out.fileno())  # the hash thread works off its backlog meanwhile
            drain()
        except BaseException:
            for update in pending:
                update.cancel()  # an abandoned file's hash is not needed: only a running update is waited for
            raise
    return FileEntry(digest.hexdigest(), size)


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


def write_bytes(path: Path, raw: bytes) -> FileEntry:
    """`raw` written, hashed and fsync'd in place (inside a temp dir that is renamed as a whole)."""
    return _stream(path, raw, ())


def write_json_file(path: Path, data: Any) -> FileEntry:
    return write_bytes(path, (json.dumps(data, indent=1) + "\n").encode())


def chunk(file: str, key: str, offsets, shape) -> dict:
    return {"file": file, "key": key, "offsets": [int(n) for n in offsets], "shape": [int(n) for n in shape]}


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
        total = math.prod(entry["shape"])
        got = sum(math.prod(piece["shape"]) for piece in entry["chunks"])
        if got != total:
            raise ValueError(f"the pieces of {name} hold {got} of its {total} elements")
        entry["chunks"].sort(key=lambda piece: piece["offsets"])
    return dict(sorted(tensors.items()))


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
        self._plain: dict[str, tuple[int, int, dict]] = {}  # file -> (fd, data start, safetensors header)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._plain.clear()

    # -- what is there

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        dtype = getattr(torch, self.tensors[name]["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.tensors[name]['dtype']!r} in a checkpoint index")
        return dtype

    # -- reading

    def read(self, name: str, out: torch.Tensor, offsets=None) -> torch.Tensor:
        """Fill `out` with the box of tensor `name` that starts at `offsets` (default: the origin) and has
        out's shape, from the chunks that overlap it, reading only the rows of each chunk the box spans."""
        entry = self.tensors[name]
        offsets = tuple(offsets or (0,) * out.dim())
        if len(offsets) != len(entry["shape"]) or out.dim() != len(entry["shape"]):
            raise ValueError(f"{name}: a box of rank {out.dim()} asked of a tensor of shape {entry['shape']}")
        filled = 0
        for piece in entry["chunks"]:
            # the overlap of the box asked for and this chunk, [start, stop) in each dim of the tensor
            start = [max(box, have) for box, have in zip(offsets, piece["offsets"], strict=True)]
            ends = zip(offsets, out.shape, piece["offsets"], piece["shape"], strict=True)
            stop = [min(box + size, have + have_size) for box, size, have, have_size in ends]
            if any(first >= end for first, end in zip(start, stop, strict=True)):
                continue
            where = zip(start, stop, offsets, strict=True)
            dst = out[tuple(slice(first - box, end - box) for first, end, box in where)]
            self._read_into(piece, start, stop, dst)
            filled += dst.numel()
        if filled != out.numel():
            raise ValueError(f"{name}: the checkpoint's chunks cover {filled} of the {out.numel()} asked for")
        return out

    def _header_of(self, file: str) -> tuple[int, int, dict]:
        """(fd, where the data starts, header) of a safetensors file, read once per reader."""
        if file not in self._plain:
            handle = self._stack.enter_context(open(self.root / file, "rb", buffering=0))  # noqa: SIM115
            fd = handle.fileno()
            (header_bytes,) = struct.unpack("<Q", _pread(fd, 8, 0))
            self._plain[file] = (fd, 8 + header_bytes, json.loads(_pread(fd, header_bytes, 8)))
        return self._plain[file]

    def _read_into(self, piece: dict, start: list[int], stop: list[int], dst: torch.Tensor) -> bool:
        """Read the box [start, stop) of chunk `piece` into `dst` with one pread of the rows it spans:
        straight into `dst` (True) when the box is whole rows (as FSDP and DDP shards and whole tensors
        are) and `dst` is contiguous host memory of the stored dtype, else into a buffer `dst` copies from
        (another device or dtype, a box of columns). No mapping of the file into this process (its pages
        never count in RSS)."""
        fd, data_start, header = self._header_of(piece["file"])
        entry = header.get(piece["key"]) or {}
        dtype = _FROM_TAG.get(entry.get("dtype"))
        shape = [int(size) for size in entry.get("shape", ())]
        begin, end = (int(offset) for offset in entry.get("data_offsets", (0, -1)))
        if dtype is None or shape != piece["shape"] or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{piece['file']}: {piece['key']} does not match the checkpoint's index")
        # the box in the chunk's own coordinates
        spans = zip(start, stop, piece["offsets"], strict=True)
        box = [slice(first - origin, end - origin) for first, end, origin in spans]
        rows = box[0] if shape else slice(0, 1)
        whole_rows = all(
            cols.start == 0 and cols.stop == size for cols, size in zip(box[1:], shape[1:], strict=True)
        )
        direct = whole_rows and dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == dtype
        buf = dst if direct else torch.empty((rows.stop - rows.start, *shape[1:]), dtype=dtype)
        first_byte = data_start + begin + rows.start * math.prod(shape[1:]) * dtype.itemsize
        _pread_into(fd, _raw(buf), first_byte)  # buf is contiguous host memory: read in place
        if not direct:
            dst.copy_(buf[(slice(None), *box[1:])].reshape(dst.shape))
        return direct

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
    return entry, sum(math.prod(reader.shape(n)) for n in names)
