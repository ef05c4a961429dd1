"""One rank of the checkpoint benchmark (run under torchrun with gloo on CPU by bench_checkpoint.py).

An FSDP-sharded GPT with real AdamW state (~1.1 GB of state in total) is saved three ways, each a few
times, in the same processes:

    full      the format-1 path: gather the full weights and optimizer state on rank 0 (torch's
              full_state_dict API, as format 1 did), rank 0 writes safetensors, fsyncs, hashes
    sharded   every rank writes its own shards (CheckpointWriter, synchronous)
    async     the same, staged to host memory and written in the background (CheckpointWriter, async)

and rank 0 measures: its peak RSS above the level before the save (VmHWM, reset through
/proc/self/clear_refs), the time the caller is blocked, the whole save's time. Throughput baselines,
like for like:

    plain_parallel  every rank at once writes its own pieces' bytes (the same tensors, as many bytes as its
                    shards) with plain sequential write() + fsync: as many plain writers as ranks
    own_*           rank 0 alone (the others wait): its shards through the checkpoint's file writer
                    (stream + sha256 + fsync) vs a plain write + fsync of the same tensors' bytes, and the
                    sha256 of those bytes alone (the ceiling of any writer that hashes every byte once)

Prints one JSON line on rank 0 and leaves one sharded checkpoint in WORKDIR/load for the one-process
load check (`python -m benchmarks.checkpoint_worker --load WORKDIR/load`, a fresh process: its peak
memory above the level before the model is built, against the model + its largest tensor).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from app.config import ModelConfig, OptimConfig
from app.files import fsync_file, sha256_file
from app.trainer.checkpoint.format import BLOCK, _raw, write_safetensors
from app.trainer.checkpoint.state import model_pieces, optimizer_pieces
from app.trainer.checkpoint.store import step_dir_name as ckpt_dir
from app.trainer.checkpoint.writer import CheckpointWriter
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer
from app.trainer.parallel.distributed import init_distributed
from app.trainer.parallel.parallelize import shard_model, unwrap

REPEATS = 3
THROUGHPUT_REPEATS = 5  # pairs: the figure a shared disk varies most
THROUGHPUT_KEYS = (
    "throughput_sharded_seconds",
    "plain_parallel_seconds",
    "own_seconds",
    "own_plain_seconds",
    "own_sha256_seconds",
)
MODEL = ModelConfig(vocab_size=16384, seq_len=32, n_layer=6, d_model=1024, n_head=16)
if os.environ.get("BENCH_CHECKPOINT_SMALL"):  # a quarter of the state, for a busy machine
    MODEL = ModelConfig(vocab_size=8192, seq_len=32, n_layer=6, d_model=512, n_head=8)


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def measure(fn, *args):
    """(RSS before the call, peak RSS during it, in bytes; seconds it took; what it returned). Freed heap
    memory is handed back first (malloc_trim), so an earlier method's garbage cannot hide a later
    method's allocations."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kb("VmRSS") * 1024.0
    t0 = time.perf_counter()
    value = fn(*args)
    seconds = time.perf_counter() - t0
    return before, _status_kb("VmHWM") * 1024.0, seconds, value


def save_in_background(writer: CheckpointWriter, step: int, model, optimizer) -> float:
    """The loop's view of an async save: how long save() blocks; then wait for the background write."""
    t0 = time.perf_counter()
    writer.save(step, model, optimizer, {}, {})
    blocked = time.perf_counter() - t0
    writer.wait()
    return blocked


def full_gather_save(model, optimizer, out: Path, rank: int) -> None:
    """What format 1 did: full state dicts on rank 0 (CPU), then rank 0 writes and hashes."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gpt = unwrap(model)
    ms = get_model_state_dict(gpt, options=opts)
    osd = get_optimizer_state_dict(gpt, optimizer, options=opts)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        ms.pop("head.weight", None)  # tied: stored once
        save_file({k: v.contiguous() for k, v in ms.items()}, str(out / "model.safetensors"))
        tensors = {
            f"{i}.{k}": v.contiguous()
            for i, entry in enumerate(osd["state"].values())
            for k, v in entry.items()
            if isinstance(v, torch.Tensor)
        }
        save_file(tensors, str(out / "optimizer.safetensors"))
        for p in out.iterdir():
            fsync_file(p)
            sha256_file(p)
    del ms, osd
    dist.barrier()


def plain_write(path: Path, tensors: list[torch.Tensor]) -> float:
    """The baseline: the same tensors' bytes, written in order with plain write() calls of BLOCK bytes
    (the writer's block size; whole-tensor writes of 64 MB were slower here with two writers at once),
    then fsync."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            view = _raw(t)
            for i in range(0, len(view), BLOCK):
                f.write(view[i : i + BLOCK])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def sha256_alone(tensors: list[torch.Tensor]) -> float:
    """Seconds to hash the bytes once, in BLOCK pieces, nothing else."""
    h = hashlib.sha256()
    start = time.perf_counter()
    for t in tensors:
        view = _raw(t)
        for i in range(0, len(view), BLOCK):
            h.update(view[i : i + BLOCK])
    return time.perf_counter() - start


def own_tensors(model, opt, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's pieces, as its checkpoint files hold them (weights, then optimizer state)."""
    pieces = model_pieces(model, rank, world)[0] + optimizer_pieces(model, opt, rank, world)[0]
    return [p.tensor for p in pieces]


def load_check(path: str) -> int:
    """A fresh process loads a sharded checkpoint into one unsharded model, the way `pretrain sample`
    does (build the model, then load_into, tensor by tensor): its peak RSS above the level before the
    model is built, against the model + its largest tensor. Prints one JSON line."""
    from app.trainer.checkpoint import store as ckpt
    from app.trainer.checkpoint.state import load_into

    info = ckpt.resolve(path)
    model, seconds = None, 0.0

    def build_and_load():
        nonlocal model
        model = build_model(MODEL)
        load_into(info, model, None)

    before, peak, seconds, _ = measure(build_and_load)
    tensors = list(model.state_dict().values())
    model_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    largest = max(t.numel() * t.element_size() for t in tensors)
    summary = {
        "load_peak": peak - before,
        "load_model_bytes": model_bytes,
        "load_largest_tensor_bytes": largest,
        "load_seconds": seconds,
        "load_world_size": info.meta.get("world_size"),
    }
    print("RESULT " + json.dumps(summary), flush=True)
    return 0


def _all_ranks_bytes(tensors: list[torch.Tensor]) -> float:
    n = torch.tensor([float(sum(t.numel() * t.element_size() for t in tensors))], dtype=torch.float64)
    dist.all_reduce(n)
    return float(n.item())


def main(workdir: str) -> int:
    env = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_model(MODEL)
    shard_model(model, torch.device("cpu"))
    opt = build_optimizer(unwrap(model), OptimConfig(), torch.device("cpu"))
    x = torch.randint(0, MODEL.vocab_size, (1, MODEL.seq_len))
    model(x, x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state_bytes = sum(p.numel() * 4 * 3 for p in unwrap(model).parameters())  # fp32 weights + 2 moments
    largest = max(p.numel() * 4 for p in unwrap(model).parameters())
    root = Path(workdir)
    results: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    sync = CheckpointWriter(root / "sync", env.rank, env.world_size, async_save=False)
    background = CheckpointWriter(root / "async", env.rank, env.world_size, async_save=True)
    nbytes = 0
    async_base = None
    for i in range(REPEATS):
        dist.barrier()
        before, peak, seconds, _ = measure(full_gather_save, model, opt, root / f"full{i}", env.rank)
        record("full_peak", peak - before)
        record("full_seconds", seconds)

        dist.barrier()
        before, peak, seconds, result = measure(sync.save, i + 1, model, opt, {}, {})
        record("sharded_peak", peak - before)
        record("sharded_seconds", seconds)
        nbytes = result.bytes

        dist.barrier()
        before, peak, seconds, blocked = measure(save_in_background, background, i + 1, model, opt)
        async_base = before if async_base is None else async_base  # the staging buffers stay allocated
        record("async_peak", peak - async_base)
        record("async_blocked" if i else "async_blocked_first", blocked)
        record("async_seconds", seconds)

        if env.rank == 0:
            for old in (root / f"full{i}", root / "sync", root / "async"):  # keep the disk use at ~1 GB
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    # Throughput, like for like, in pairs whose order alternates, each write starting from a drained page
    # cache (os.sync): the disk of a shared machine is in a different state after every big write.
    # All ranks: a sharded save vs as many plain writers as ranks, each writing its own pieces' bytes.
    # Rank 0 alone (the others wait): its shards through the checkpoint's file writer (stream + sha256 +
    # fsync) vs a plain write of the same bytes, and the sha256 of those bytes alone.
    mine = own_tensors(model, opt, env.rank, env.world_size)
    record("plain_parallel_bytes", _all_ranks_bytes(mine))

    def timed(fn) -> float:
        os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    steps = iter(range(100, 100 + THROUGHPUT_REPEATS))

    def sharded_save() -> None:
        step = next(steps)
        sync.save(step, model, opt, {}, {})
        if env.rank == 0:
            shutil.rmtree(root / "sync" / ckpt_dir(step), ignore_errors=True)

    def plain_parallel() -> None:
        plain_write(root / f"plain-rank{env.rank}.bin", mine)

    def own_write() -> None:
        if env.rank == 0:
            write_safetensors(root / "own.safetensors", [(f"t{j}", t) for j, t in enumerate(mine)])
            (root / "own.safetensors").unlink()

    def own_plain() -> None:
        if env.rank == 0:
            plain_write(root / "plain.bin", mine)

    pairs = [
        (("throughput_sharded_seconds", sharded_save), ("plain_parallel_seconds", plain_parallel)),
        (("own_seconds", own_write), ("own_plain_seconds", own_plain)),
    ]
    for i in range(THROUGHPUT_REPEATS):
        for pair in pairs:
            for name, fn in pair if i % 2 == 0 else pair[::-1]:
                record(name, timed(fn))
        if env.rank == 0:
            record("own_sha256_seconds", sha256_alone(mine))
    record("own_bytes", float(sum(t.numel() * t.element_size() for t in mine)))  # rank 0's: printed
    CheckpointWriter(root / "load", env.rank, env.world_size).save(1, model, opt, {}, {})
    if env.rank == 0:
        summary = {k: statistics.median(v) for k, v in results.items()}
        # the throughput pairs: the best of each (what the writer can do when the shared disk and CPUs
        # are not taken by others; a median still swung from 84% to 172% between runs here)
        summary.update({k: min(results[k]) for k in THROUGHPUT_KEYS})
        summary.update(
            world_size=env.world_size, state_bytes=state_bytes, largest_tensor_bytes=largest, bytes=nbytes
        )
        print("RESULT " + json.dumps(summary), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(load_check(sys.argv[2]) if sys.argv[1] == "--load" else main(sys.argv[1]))
