"""Checkpoint write throughput against a plain sequential write of the same number of bytes to the
same disk in the same run, and the SIGTERM-to-exit latency of the tiny preset."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from app.config import ModelConfig
from app.trainer.checkpoint import CheckpointWriter
from app.trainer.model import build_model

REPEATS = 3
REPO = Path(__file__).resolve().parents[1]


def _model_and_optimizer():
    """A ~45M-parameter model (~0.5 GB with AdamW moments) with real optimizer state."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=8192, seq_len=64, n_layer=6, d_model=768, n_head=12))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 8192, (1, 64))
    model(x, x).loss.backward()
    opt.step()
    return model, opt


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


def run() -> list[str]:
    model, opt = _model_and_optimizer()
    ckpt_s, plain_s, sizes = [], [], []
    with tempfile.TemporaryDirectory(dir=REPO / ".cache" if (REPO / ".cache").is_dir() else None) as tmp:
        tmp = Path(tmp)
        writer = CheckpointWriter(tmp, 0, 1, lambda: None)
        for i in range(REPEATS):
            res = writer.save(i + 1, model.state_dict(), opt.state_dict(), {"step": i + 1}, {})
            ckpt_s.append(res.seconds)
            sizes.append(res.bytes)
            plain_s.append(plain_write(tmp / "plain.bin", res.bytes))
        latencies = [sigterm_latency(tmp) for _ in range(REPEATS)]
    c, p = statistics.median(ckpt_s), statistics.median(plain_s)
    gb = sizes[0] / 1e9
    return [
        f"checkpoint {gb:.2f} GB: {gb / c:.2f} GB/s (write + fsync + sha256 + rename), plain sequential write "
        f"+ fsync {gb / p:.2f} GB/s: ratio {p / c:.0%} (goal >= 80%)",
        f"SIGTERM-to-exit latency, tiny preset (finish step, checkpoint, exit 143): median "
        f"{statistics.median(latencies) * 1e3:.0f} ms over {REPEATS} runs",
    ]
