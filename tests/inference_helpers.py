"""A small trained checkpoint for the inference tests (serve, eval, the sample CLI), trained once and
cached across test sessions in the test cache (CI starts empty and trains it once per run)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

from tests.conftest import CACHE, FAST, pretrain

STEPS = 120
ARGS = [
    "--max-steps",
    str(STEPS),
    *FAST,
    "--set",
    "train.eval_every=60",
    "--set",
    "checkpoint.every_steps=60",
    "--set",
    "optim.lr=3e-3",
    "--set",
    "schedule.warmup_steps=10",
]


def trained_run() -> Path:
    """A run dir with checkpoints at steps 60 and 120 (both with a val loss)."""
    from app.trainer.checkpoint import FORMAT_VERSION

    key = hashlib.sha256(repr((ARGS, FORMAT_VERSION)).encode()).hexdigest()[:12]
    target = CACHE / f"run-infer-{key}"
    if (target / "_DONE").exists():
        return target
    tmp = CACHE / f".run-infer-{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    pretrain("train", "--out", str(tmp), *ARGS, check=True, timeout=600)
    (tmp / "_DONE").touch()
    try:
        os.replace(tmp, target)
    except OSError:  # another session finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
