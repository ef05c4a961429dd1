"""Checkpoint saves on 2 CPU gloo ranks (an FSDP-sharded GPT with ~1.1 GB of weights + AdamW state),
each figure against a baseline measured in the same run (benchmarks/checkpoint_worker.py does the work):

- peak host RSS of rank 0 above its level before the save: the format-1 full gather on rank 0 vs
  sharded writes (synchronous, and asynchronous with its staging copy); target for the new format:
  <= state / world_size + one tensor
- time the loop is blocked per save: synchronous vs asynchronous (target: async <= 20% of sync)
- write throughput, like for like (target >= 80%): a sharded save (write + sha256 + fsync + commit, all
  ranks) vs as many plain writers as ranks, each writing its own pieces' bytes (write() + fsync) at
  once; and one writer alone (rank 0's shards through the checkpoint's file writer) vs a plain write of
  the same bytes, with the sha256 of those bytes alone as the ceiling of any writer that hashes them
- loading that sharded checkpoint into one process (what `pretrain sample` does), in a fresh process:
  peak RSS above the level before the model is built, against the model + its largest tensor

and the SIGTERM-to-exit latency of the tiny preset (finish the step, checkpoint, exit 143).
BENCH_CHECKPOINT_SMALL=1 runs a model of a quarter of the size (for a busy machine).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPEATS = 3
WORLD = 2
REPO = Path(__file__).resolve().parents[1]


def sigterm_latency(workdir: Path) -> float:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run = workdir / f"term-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "train",
            "--out",
            str(run),
            "--set",
            "train.eval_every=0",
            "--set",
            "train.log_every=1",
            "--set",
            "metrics.progress=false",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("step 5/"):
            break
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.stdout.read()
    proc.wait()
    assert proc.returncode == 143, proc.returncode
    return time.perf_counter() - start


def sharded_saves(workdir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += ["-m", "benchmarks.checkpoint_worker", str(workdir)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"checkpoint worker failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def load_in_one_process(checkpoint: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "benchmarks.checkpoint_worker", "--load", str(checkpoint)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"checkpoint load check failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def run() -> list[str]:
    cache = REPO / ".cache"
    cache.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp = Path(tmp)
        r = sharded_saves(tmp)
        r.update(load_in_one_process(tmp / "load"))
        latencies = [sigterm_latency(tmp) for _ in range(REPEATS)]
    gb = 1e9
    state, world = r["state_bytes"], r["world_size"]
    target = state / world + r["largest_tensor_bytes"]
    new_peak = max(
        r["sharded_peak"], r["async_peak"]
    )  # medians; async: above the level before its first save
    blocked = r["async_blocked"] / r["sharded_seconds"]
    throughput = r["plain_parallel_seconds"] / r["throughput_sharded_seconds"]
    own, own_gb = r["own_plain_seconds"] / r["own_seconds"], r["own_bytes"] / gb
    load_target = r["load_model_bytes"] + r["load_largest_tensor_bytes"]
    return [
        f"peak RSS of rank 0 above its level during a save, {world} gloo ranks, {state / gb:.2f} GB of state: "
        f"full gather (format 1) {r['full_peak'] / gb:.2f} GB, sharded sync {r['sharded_peak'] / gb:.2f} GB, "
        f"sharded async {r['async_peak'] / gb:.2f} GB (staging, kept between saves); "
        f"new/old {new_peak / r['full_peak']:.0%}; "
        f"target state/{world} + one tensor = {target / gb:.2f} GB: {'met' if new_peak <= target else 'MISSED'}",
        f"loop blocked per save: sync {r['sharded_seconds']:.2f} s, async {r['async_blocked']:.2f} s "
        f"(write goes on {r['async_seconds'] - r['async_blocked']:.2f} s in the background; the first "
        f"async save, allocating its staging buffers, {r['async_blocked_first']:.2f} s): {blocked:.0%} of "
        f"sync (goal <= 20%); full gather (format 1) {r['full_seconds']:.2f} s",
        f"write throughput (best of 5 alternating pairs), {r['bytes'] / gb:.2f} GB sharded checkpoint: "
        f"{r['bytes'] / gb / r['throughput_sharded_seconds']:.2f} "
        f"GB/s (write + sha256 + fsync + commit, {world} ranks) vs {world} plain writers at once (write + "
        f"fsync of the same tensors, {r['plain_parallel_bytes'] / gb:.2f} GB) "
        f"{r['plain_parallel_bytes'] / gb / r['plain_parallel_seconds']:.2f} GB/s: ratio {throughput:.0%} "
        f"(goal >= 80%: {'met' if throughput >= 0.8 else 'MISSED'}); one writer alone, {own_gb:.2f} GB: "
        f"{own_gb / r['own_seconds']:.2f} GB/s vs plain {own_gb / r['own_plain_seconds']:.2f} GB/s: ratio "
        f"{own:.0%}; its sha256 alone {own_gb / r['own_sha256_seconds']:.2f} GB/s (ceiling "
        f"{r['own_plain_seconds'] / r['own_sha256_seconds']:.0%} of plain for one stream that hashes every byte)",
        f"sharded checkpoint ({r['load_world_size']} ranks) loaded into one process (build + load tensor by "
        f"tensor, as `pretrain sample`): peak RSS above the level before {r['load_peak'] / gb:.2f} GB vs the "
        f"model + its largest tensor {load_target / gb:.2f} GB: ratio {r['load_peak'] / load_target:.0%} "
        f"(target <= 100%: {'met' if r['load_peak'] <= load_target else 'MISSED'}), {r['load_seconds']:.2f} s",
        f"SIGTERM-to-exit latency, tiny preset (finish step, checkpoint, exit 143): median "
        f"{statistics.median(latencies) * 1e3:.0f} ms over {REPEATS} runs",
    ]
