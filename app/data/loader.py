"""Memory-mapped loader of fixed-length windows drawn deterministically from (seed, sample index).

The token stream of each shard is cut into cells of seq_len tokens; window i reads seq_len + 1 tokens
(inputs and shifted targets) from the start of cell i. Every epoch visits all windows once in an order
fixed by (seed, epoch). Global sample k of the run is window perm_epoch[k mod W] with epoch = k div W;
rank r of a world of size R takes samples k = (micro_step * R + r) * B + j. Ranks never overlap within
an epoch, and the whole position is one integer (`micro_steps` done), which a checkpoint stores.

With data.align_to_documents a window starts at the first document boundary inside its cell instead:
at the `<|endoftext|>` token that ends the previous document, which then plays the role of the
record's BOS token (the first input of every sequence, the document's first token its first target).
A cell inside one long document keeps its start. The window index, the number of windows and the
position stay as they are, so exact resume and the epoch arithmetic do not change; the cost is that
the tokens between a cell's start and its first boundary (a document's tail) are skipped when the
window before ended earlier, and the next document's first tokens are read twice when it ended later
(docs/recipes.md, "Document-aligned windows").
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from app.config import DataConfig, ModelConfig
from app.data.manifest import Manifest
from app.data.shards import open_shard, verify_shard
from app.errors import UserError


@dataclass
class LoaderState:
    micro_steps: int = 0  # micro-batches drawn by each rank so far (same on every rank)
    world_size: int = 1
    micro_batch_size: int = 1

    @property
    def samples(self) -> int:
        """Global samples consumed: what carries over when the world size changes."""
        return self.micro_steps * self.world_size * self.micro_batch_size


class TokenWindows:
    """All windows of one split, addressable by a global window index."""

    def __init__(
        self, data_dir: Path, split: str, seq_len: int, vocab_size: int = 0, align_to_documents: bool = False
    ) -> None:
        self.data_dir = Path(data_dir)
        self.manifest = Manifest.load(self.data_dir)
        self.seq_len, self.split, self.vocab_size = seq_len, split, vocab_size
        # the boundary token every tokenizer puts after each document (app/data/tokenizer.py)
        self.boundary = int(self.manifest.tokenizer["eot_id"]) if align_to_documents else None
        shards = self.manifest.split(split)
        if not shards:
            raise UserError(f"{data_dir} has no '{split}' shards; re-run `pretrain prepare`")
        dtype = np.dtype(self.manifest.dtype)
        for s in shards:  # sizes and headers against the manifest: cheap, catches a truncated or swapped file
            if why := verify_shard(self.data_dir / s.file, dtype, s.tokens):
                raise UserError(f"data {data_dir}: {why}; re-run `pretrain prepare --out {data_dir}`")
        self.arrays = [open_shard(self.data_dir / s.file) for s in shards]
        counts = np.array([max(0, (a.size - 1) // seq_len) for a in self.arrays], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.count = int(self.offsets[-1])
        if self.count == 0:
            total = sum(a.size for a in self.arrays)
            raise UserError(
                f"'{split}' split of {data_dir} has {total} tokens, fewer than one window of "
                f"seq_len+1={seq_len + 1}; lower model.seq_len or prepare more data"
            )

    def window(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        tokens = self.arrays[shard]
        start = (index - int(self.offsets[shard])) * self.seq_len
        if self.boundary is not None:
            # the first boundary in the cell, as long as a whole window still fits in the shard after it
            last_start = tokens.size - self.seq_len - 1
            cell = tokens[start : min(start + self.seq_len, last_start + 1)]
            hits = np.flatnonzero(cell == self.boundary)
            if hits.size:
                start += int(hits[0])
        return tokens[start : start + self.seq_len + 1]

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """The windows as one contiguous (B, T+1) int32 tensor: the ids a device copy moves in one piece
        (int64 is made on the device; uint16 shards are widened here, an int32 on a GPU widens to int64
        with any torch). Inputs are rows[:, :-1], targets rows[:, 1:] (`split_rows`)."""
        rows = np.stack([self.window(int(i)) for i in indices]).astype(np.int32, copy=False)
        if self.vocab_size and (top := int(rows.max())) >= self.vocab_size:
            raise UserError(
                f"the '{self.split}' shards of {self.data_dir} hold token id {top}, beyond the model's vocab "
                f"size {self.vocab_size}: they do not match their tokenizer; re-run `pretrain prepare`"
            )
        return torch.from_numpy(rows)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return split_rows(self.rows(indices))


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) as int64 views of one (B, T+1) tensor of token ids, on its device."""
    rows = rows.long()
    return rows[:, :-1], rows[:, 1:]


class TrainLoader:
    def __init__(
        self,
        data_dir: Path,
        seq_len: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        vocab_size: int = 0,
        align_to_documents: bool = False,
    ) -> None:
        self.windows = TokenWindows(data_dir, "train", seq_len, vocab_size, align_to_documents)
        self.B, self.rank, self.world, self.seed = micro_batch_size, rank, world_size, seed
        self.state = LoaderState(0, world_size, micro_batch_size)
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.windows.count)
            self._perm_epoch = epoch
        return self._perm

    def indices(self, micro_step: int) -> np.ndarray:
        """Window indices of this rank's micro-batch number `micro_step`."""
        W = self.windows.count
        first = (micro_step * self.world + self.rank) * self.B
        out = np.empty(self.B, dtype=np.int64)
        for j in range(self.B):
            epoch, pos = divmod(first + j, W)
            out[j] = self._permutation(epoch)[pos]
        return out

    def rows_at(self, micro_step: int) -> torch.Tensor:
        """This rank's micro-batch number `micro_step` as (B, T+1) token ids (the position does not move)."""
        return self.windows.rows(self.indices(micro_step))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = split_rows(self.rows_at(self.state.micro_steps))
        self.state.micro_steps += 1
        return x, y

    def state_dict(self) -> dict:
        return {**asdict(self.state), "samples": self.state.samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume; with a different world size or micro-batch, continue from the same global sample."""
        if state["world_size"] == self.world and state["micro_batch_size"] == self.B:
            self.state.micro_steps = int(state["micro_steps"])
        else:
            per_step = self.world * self.B
            self.state.micro_steps = -(-int(state["samples"]) // per_step)  # ceil: never repeat a sample


class Prefetcher:
    """A loader's micro-batches on the device. On CUDA they are read `depth` ahead on a side thread into
    pinned memory, one contiguous (B, T+1) int32 tensor each, which the loop copies without blocking and
    widens and splits on the GPU: the GPU never waits for the memmap and the copy never goes through a
    pageable staging buffer. On a CPU the batch is read in the loop: the read (a memmap slice, microseconds)
    saves nothing there, and a reading thread only competes with the step's compute threads for the cores
    (docs/performance.md). The loader's position moves when a batch is taken, not when it is read ahead:
    checkpoints stay exact. Errors of the reading thread (e.g. token ids beyond the vocab) are raised by
    the `next()` that meets them. `source` has `rows_at(micro_step)` and `state.micro_steps` (TrainLoader,
    or synthetic batches). `wait_seconds` adds up the time the loop waited in `next()`.

    Not testable without a GPU: that pinned memory and the non-blocking copy overlap the step (the CPU
    tests check the layout that makes it possible: `host_rows` is one contiguous int32 tensor)."""

    def __init__(self, source, device: torch.device, depth: int, threaded: bool | None = None) -> None:
        self.source, self.device = source, device
        self.pin = device.type == "cuda"
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wait_seconds = 0.0
        if depth > 0 and (self.pin if threaded is None else threaded):  # threaded: tests run it on a CPU
            self._queue = queue.Queue(maxsize=depth)
            first = source.state.micro_steps
            self._thread = threading.Thread(target=self._read, args=(first,), name="prefetch", daemon=True)
            self._thread.start()

    def host_rows(self, micro_step: int) -> torch.Tensor:
        """Micro-batch `micro_step` as the device copy reads it: (B, T+1) int32, contiguous, pinned on CUDA."""
        rows = self.source.rows_at(micro_step).to(torch.int32).contiguous()
        return rows.pin_memory() if self.pin else rows

    def _read(self, micro_step: int) -> None:
        while not self._stop.is_set():
            try:
                item = self.host_rows(micro_step)
            except BaseException as e:  # handed to the loop, which raises it
                item = e
            self._queue.put(item)  # blocks while the queue is full (no polling); close() makes room
            if isinstance(item, BaseException):
                return
            micro_step += 1

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        if self._queue is None:
            rows = self.host_rows(self.source.state.micro_steps)
        else:
            rows = self._queue.get()
            if isinstance(rows, BaseException):
                raise rows
        self.source.state.micro_steps += 1
        self.wait_seconds += time.perf_counter() - start
        return split_rows(rows.to(self.device, non_blocking=True))

    def close(self) -> None:
        """Stop the reader and wait for it: a thread still inside torch at interpreter exit aborts it."""
        self._stop.set()
        while self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()  # a reader blocked on a full queue wakes, sees the stop and ends
            self._thread.join(timeout=0.01)


def val_batches(
    data_dir: Path,
    seq_len: int,
    micro_batch_size: int,
    batches: int,
    rank: int,
    world_size: int,
    vocab_size: int = 0,
):
    """The same fixed validation windows at every eval, spread evenly over the split, split by rank.

    Every rank gets the same number of batches (FSDP runs a collective per forward), repeating a
    window when the split has fewer windows than ranks need."""
    windows = TokenWindows(data_dir, "val", seq_len, vocab_size)
    per_rank = -(-min(windows.count, batches * micro_batch_size * world_size) // world_size)
    chosen = np.linspace(0, windows.count - 1, per_rank * world_size).astype(np.int64)
    mine = chosen[rank::world_size]
    for i in range(0, len(mine), micro_batch_size):
        yield windows.batch(mine[i : i + micro_batch_size])


def resolve_data_dir(data: DataConfig, log) -> Path:
    """The data dir to train on: the embedded corpus (built on first use) or a `pretrain prepare` output."""
    if data.dataset == "embedded":
        from app.data.corpus import embedded_dataset

        return embedded_dataset(data.tokenizer, data.vocab_size, data.val_fraction, data.cache_dir, log=log)
    path = Path(data.dataset)
    if not path.is_dir():
        raise UserError(f"data.dataset={path} is not a directory; run `pretrain prepare --out {path}` first")
    return path


def fit_vocab(model: ModelConfig, manifest: Manifest, data_dir: Path) -> None:
    """The model's vocab comes from the data unless set; shards with bigger ids are refused."""
    vocab = manifest.vocab_size
    if model.vocab_size == 0:
        model.vocab_size = vocab
    elif vocab > model.vocab_size:
        raise UserError(
            f"the tokenizer of {data_dir} has {vocab} tokens but model.vocab_size={model.vocab_size}; "
            f"set model.vocab_size >= {vocab} or prepare the data with a matching tokenizer"
        )
