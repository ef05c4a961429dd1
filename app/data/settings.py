"""The checks of what `pretrain prepare` takes (PrepareConfig, in app/config/prepare.py), and how many workers
it may use."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from app.config.prepare import PrepareConfig
from app.data.shards import dtype_for_vocab
from app.data.tokenizer import check_bpe_vocab
from app.errors import UserError


def check_config(cfg: PrepareConfig) -> None:
    if not cfg.inputs:
        raise UserError("no input: pass --input PATH or --input hf://datasets/OWNER/NAME")
    if not 0 < cfg.val_fraction < 0.5:
        raise UserError(f"--val-fraction must be in (0, 0.5), got {cfg.val_fraction}")
    if cfg.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be >= 1, got {cfg.shard_tokens}")
    if cfg.dtype not in ("auto", "uint16", "uint32"):
        raise UserError(f"--dtype must be auto, uint16 or uint32, got {cfg.dtype}")
    if cfg.tokenizer == "bpe":
        check_bpe_vocab(cfg.vocab_size)
        check_dtype(cfg.vocab_size, cfg.dtype)
    if cfg.txt_split not in ("file", "line", "paragraph"):
        raise UserError(f"--txt-split must be file, line or paragraph, got {cfg.txt_split}")
    if cfg.verify not in ("sha256", "size"):
        raise UserError(f"--verify must be sha256 or size, got {cfg.verify}")
    if cfg.sample_bytes < 1:
        raise UserError(f"--tokenizer-sample-bytes must be >= 1, got {cfg.sample_bytes}")
    if cfg.shard_count < 1:
        raise UserError(f"--shard-count must be >= 1, got {cfg.shard_count}")
    if not 0 <= cfg.shard_index < cfg.shard_count:
        raise UserError(
            f"--shard-index must be in 0..{cfg.shard_count - 1} (--shard-count {cfg.shard_count}), got {cfg.shard_index}"
        )
    if cfg.finalize and cfg.shard_count == 1:
        raise UserError(
            "--finalize joins the shares of a sharded prepare: give their --shard-count N (N > 1)"
        )


def check_dtype(vocab_size: int, dtype: str) -> np.dtype:
    if dtype == "uint16" and vocab_size > 2**16:
        raise UserError(
            f"a vocabulary of {vocab_size} tokens does not fit --dtype uint16 (at most 65536); "
            "use --dtype uint32 or auto"
        )
    if vocab_size > 2**32:
        raise UserError(f"a vocabulary of {vocab_size} tokens does not fit uint32 token ids")
    return np.dtype(dtype) if dtype != "auto" else dtype_for_vocab(vocab_size)


def default_workers() -> int:
    """Cores this process may use: CPU affinity, capped by a cgroup CPU quota (a Kubernetes CPU limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def _cgroup_cpu_quota() -> int:
    """ceil(quota / period) from cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`; 0 when unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return 0 if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return math.ceil(quota / period) if quota > 0 and period > 0 else 0
    except (OSError, ValueError):
        return 0
