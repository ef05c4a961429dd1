"""What the machine decides for the loop: the device, the autocast dtype, and how one optimizer step's
batch is laid out over ranks and micro-batches."""

from __future__ import annotations

import contextlib

import torch

from app.config import Config
from app.errors import ConfigError


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def autocast_for(cfg: Config, device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights), fp32 on CPU unless train.dtype=bf16."""
    if device.type == "cuda" and cfg.train.dtype in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if cfg.train.dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    per_micro = cfg.train.micro_batch_size * cfg.model.seq_len * world_size
    if not cfg.train.batch_tokens:
        return 1
    if cfg.train.batch_tokens % per_micro:
        raise ConfigError(
            f"train.batch_tokens={cfg.train.batch_tokens} is not a multiple of micro_batch_size x seq_len x "
            f"world_size = {per_micro}; use a multiple such as {max(1, round(cfg.train.batch_tokens / per_micro)) * per_micro}"
        )
    return cfg.train.batch_tokens // per_micro
