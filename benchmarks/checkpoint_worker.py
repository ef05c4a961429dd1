"""One rank of the checkpoint benchmark (run under torchrun with gloo on CPU by bench_checkpoint.py).

An FSDP-sharded GPT with real AdamW state (~1.1 GB of state in total) is saved three ways, each a few
times, in the same processes:

    full      the format-1 path: gather the full weights and optimizer state on rank 0 (torch's
              full_state_dict API, as format 1 did), rank 0 writes safetensors, fsyncs, hashes
    sharded   every rank writes its own shards (CheckpointWriter, synchronous)
    async     the same, staged to host memory and written in the background (CheckpointWriter, async)

and rank 0 measures: its peak RSS above the level before the save (VmHWM, reset through
/proc/self/clear_refs), the time the caller is blocked, the whole save's time; and, for the throughput
baseline, a plain sequential write + fsync of as many bytes as the sharded checkpoint holds. Prints one
JSON line on rank 0.
"""

from __future__ import annotations

import ctypes
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
from app.trainer.checkpoint_format import write_safetensors
from app.trainer.checkpoint_writer import CheckpointWriter
from app.trainer.model import build_model
from app.trainer.optim import build_optimizer
from app.trainer.parallel import init_distributed, model_pieces, optimizer_pieces, shard_model, unwrap

REPEATS = 3
MODEL = ModelConfig(vocab_size=16384, seq_len=32, n_layer=6, d_model=1024, n_head=16)


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


def plain_write(path: Path, nbytes: int) -> float:
    block = os.urandom(8 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


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

    sync = CheckpointWriter(root / "sync", env.rank, env.world_size, env.barrier, async_save=False)
    background = CheckpointWriter(root / "async", env.rank, env.world_size, env.barrier, async_save=True)
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

        dist.barrier()
        if env.rank == 0:
            record("plain_seconds", plain_write(root / "plain.bin", nbytes))
            # One writer alone, the same bytes both ways: rank 0's shards through the checkpoint writer
            # (stream + sha256 + fsync) against a plain write of as many bytes.
            pieces = (
                model_pieces(model, 0, env.world_size)[0] + optimizer_pieces(model, opt, 0, env.world_size)[0]
            )
            t0 = time.perf_counter()
            own = write_safetensors(root / "own.safetensors", [(p.name, p.tensor) for p in pieces])
            record("own_seconds", time.perf_counter() - t0)
            record("own_plain_seconds", plain_write(root / "plain.bin", own.bytes))
            record("own_bytes", own.bytes)
            (root / "own.safetensors").unlink()
            for old in (root / f"full{i}", root / "sync", root / "async"):  # keep the disk use at ~1 GB
                shutil.rmtree(old, ignore_errors=True)
    if env.rank == 0:
        summary = {k: statistics.median(v) for k, v in results.items()}
        summary.update(
            world_size=env.world_size, state_bytes=state_bytes, largest_tensor_bytes=largest, bytes=nbytes
        )
        print("RESULT " + json.dumps(summary), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
