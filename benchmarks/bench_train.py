"""Tokens/s of the tiny preset on CPU, and the overhead of the training loop's extras (stop checks,
JSONL log, Prometheus gauges, status file, progress bar) against a bare forward/backward/step loop
over the same model and data, measured alternately in the same process."""

from __future__ import annotations

import io
import json
import socket
import statistics
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

from app.config import load_config
from app.data.loader import TrainLoader, resolve_data_dir
from app.data.manifest import Manifest
from app.train import RunArgs, train
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer

STEPS = 60
WARMUP = 10  # steps excluded from both timings
REPEATS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config():
    cfg = load_config(
        "tiny",
        overrides=[
            "train.eval_every=0",
            "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0",
            f"train.max_steps={STEPS}",
        ],
    )
    return cfg


def trainer_seconds(workdir: Path) -> float:
    """Seconds per step of the real loop (`train()`, as `pretrain train` runs it), between step WARMUP and
    STEPS, from its own JSONL clock."""
    cfg = _config()
    cfg.train.log_every = 1  # the most logging the loop can do: its numbers are read every step
    cfg.metrics.port = _free_port()
    run = workdir / f"run-{time.monotonic_ns()}"
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert train(cfg, RunArgs(run, "never")) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows if r["kind"] == "train"}
    return (times[STEPS] - times[WARMUP]) / (STEPS - WARMUP)


def bare_seconds() -> float:
    """Seconds per step of forward/backward/clip/step/zero_grad and nothing else."""
    cfg = _config()
    data_dir = resolve_data_dir(cfg.data, log=lambda m: None)
    cfg.model.vocab_size = Manifest.load(data_dir).vocab_size
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    loader = TrainLoader(data_dir, cfg.model.seq_len, cfg.train.micro_batch_size, 0, 1, cfg.train.seed)
    start = 0.0
    for step in range(STEPS):
        if step == WARMUP:
            start = time.perf_counter()
        x, y = loader.next()
        loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return (time.perf_counter() - start) / (STEPS - WARMUP)


def run() -> list[str]:
    cfg = _config()
    tokens_per_step = cfg.train.micro_batch_size * cfg.model.seq_len
    loop, bare = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(REPEATS):  # alternate, so drift in machine load hits both alike
            bare.append(bare_seconds())
            loop.append(trainer_seconds(Path(tmp)))
    b, t = statistics.median(bare), statistics.median(loop)
    return [
        f"tiny preset on CPU ({torch.get_num_threads()} threads): {tokens_per_step / t:,.0f} tokens/s "
        f"in the full loop, {tokens_per_step / b:,.0f} tokens/s bare",
        f"loop overhead vs bare loop: {t / b - 1:+.2%} (goal < 1%; median of {REPEATS} alternating runs, "
        f"bare {[f'{x * 1e3:.1f}' for x in bare]} ms/step, loop {[f'{x * 1e3:.1f}' for x in loop]} ms/step)",
    ]
