"""A small trained checkpoint for the inference tests (serve, eval, the sample CLI), trained once and
cached across test sessions in the test cache (CI starts empty and trains it once per run)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

from tests.conftest import CACHE, CLASSIC, FAST, pretrain

STEPS = 120
ARGS = [
    "--max-steps",
    str(STEPS),
    *FAST,
    *CLASSIC,  # the val losses below were set on AdamW
    "--set",
    "train.eval_every=60",
    "--set",
    "checkpoint.every_steps=60",
    "--set",
    "optim.lr=3e-3",
    "--set",
    "schedule.warmup_steps=10",
]


# trained_run() resumed for 4 more steps at a constant, far too high LR: the newest checkpoint is worse
WORSE = [
    "--max-steps",
    str(STEPS + 4),
    *FAST,
    *CLASSIC,
    "--set",
    "train.eval_every=4",
    "--set",
    "checkpoint.every_steps=4",
    "--set",
    "schedule.name=constant",
    "--set",
    "schedule.warmup_steps=0",
    "--set",
    "optim.lr=0.05",
]


def _cached(name: str, key_parts: tuple, build) -> Path:
    """CACHE/<name>-<key>, built once by build(tmp_dir) into a temp dir and renamed into place."""
    from app.trainer.checkpoint.store import FORMAT_VERSION

    key = hashlib.sha256(repr((*key_parts, FORMAT_VERSION)).encode()).hexdigest()[:12]
    target = CACHE / f"{name}-{key}"
    if (target / "_DONE").exists():
        return target
    tmp = CACHE / f".{name}-{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / "_DONE").touch()
    try:
        os.replace(tmp, target)
    except OSError:  # another session finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def trained_run() -> Path:
    """A run dir with checkpoints at steps 60 and 120 (both with a val loss)."""
    return _cached(
        "run-infer", (ARGS,), lambda tmp: pretrain("train", "--out", str(tmp), *ARGS, check=True, timeout=600)
    )


def best_is_not_latest_run() -> Path:
    """A run dir whose best checkpoint is not its latest: steps 60, 120 (the lowest val loss) and 124
    (the newest, after 4 steps at a far too high LR: a clearly higher val loss)."""

    def build(tmp: Path) -> None:
        shutil.copytree(trained_run(), tmp, ignore=shutil.ignore_patterns("_DONE", "eval"))
        pretrain("train", "--out", str(tmp), *WORSE, check=True, timeout=600)

    return _cached("run-infer-worse", (ARGS, WORSE), build)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
