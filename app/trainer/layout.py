"""Batch layout for a GPU type and count: the micro-batch x gradient accumulation that keeps the preset's
global batch (train.batch_tokens) and fits each GPU's memory by the estimate in app/trainer/memory.py.
Pure arithmetic, no torch: `pretrain plan` prints it, `pretrain train --gpu-type T --gpus N` applies it.

Rule: the largest micro-batch (a divisor of the sequences each rank handles per step) whose estimate
fits 90% of the GPU's memory in the parallel mode the trainer would run (train.parallel; auto picks
FSDP when DDP does not fit); if none fits, the same search with activation checkpointing on; if still
none, the layout does not fit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from app.budget.pricing import normalize
from app.config import Config
from app.errors import UserError
from app.trainer.memory import GB, GPU_MEMORY_GB, HEADROOM, choose, estimates


@dataclass(frozen=True)
class Layout:
    gpu_type: str
    gpus: int
    micro_batch: int  # sequences per rank per forward pass; 0 = nothing fits
    accum: int
    mode: str  # ddp | fsdp
    checkpointing: bool
    gb_per_gpu: float  # the estimate
    device_gb: float

    @property
    def fits(self) -> bool:
        return self.micro_batch > 0

    def describe(self) -> str:
        head = f"{self.gpus} x {self.gpu_type}"
        if not self.fits:
            return f"{head}: does not fit even at micro-batch 1 with activation checkpointing"
        ac = ", activation checkpointing" if self.checkpointing else ""
        return (
            f"{head}: micro-batch {self.micro_batch} x accumulation {self.accum} per rank, "
            f"{self.mode.upper()}{ac}, {self.gb_per_gpu:.0f} of {self.device_gb:.0f} GB per GPU"
        )


def fit(cfg: Config, gpu_type: str, gpus: int) -> Layout:
    """The layout for `gpus` GPUs of `gpu_type` (model.vocab_size must be set)."""
    key = normalize(gpu_type)
    if key not in GPU_MEMORY_GB:
        raise UserError(
            f"unknown GPU type '{gpu_type}' for a batch layout; use one of: {', '.join(GPU_MEMORY_GB)}"
        )
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    device = GPU_MEMORY_GB[key] * GB
    seq = cfg.model.seq_len
    t = cfg.train
    if t.batch_tokens:
        if t.batch_tokens % (seq * gpus):
            raise UserError(
                f"train.batch_tokens={t.batch_tokens} does not split over {gpus} GPUs x seq {seq}; "
                f"use a multiple of {seq * gpus}"
            )
        per_rank = t.batch_tokens // (seq * gpus)
        micros = [d for d in range(per_rank, 0, -1) if per_rank % d == 0]
    else:
        per_rank = t.micro_batch_size  # no global batch fixed: keep the micro-batch, no accumulation
        micros = [per_rank]
    trial = copy.deepcopy(cfg)
    trial.train.device_memory_gb = GPU_MEMORY_GB[key]
    for checkpointing in [t.activation_checkpointing] + ([] if t.activation_checkpointing else [True]):
        trial.train.activation_checkpointing = checkpointing
        for micro in micros:
            trial.train.micro_batch_size = micro
            est = estimates(trial, gpus, cuda=True)
            mode, _ = choose(t.parallel, est["ddp"], est["fsdp"], int(device), gpus)
            need = est[mode].total
            if need <= device * HEADROOM:
                return Layout(
                    key, gpus, micro, per_rank // micro, mode, checkpointing, need / GB, device / GB
                )
    return Layout(key, gpus, 0, 0, t.parallel, True, 0.0, device / GB)


def apply(cfg: Config, layout: Layout) -> None:
    """Set the config to the layout (the trainer then derives the accumulation from batch_tokens)."""
    if not layout.fits:
        raise UserError(
            f"{layout.describe()}; use more GPUs, a GPU with more memory, or a smaller train.batch_tokens"
        )
    cfg.train.micro_batch_size = layout.micro_batch
    cfg.train.activation_checkpointing = layout.checkpointing
    cfg.train.device_memory_gb = layout.device_gb
