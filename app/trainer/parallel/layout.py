"""Batch layout: the micro-batch x gradient accumulation that keeps the global batch (train.batch_tokens)
and fits each GPU's memory by the estimate in app/trainer/parallel/memory.py. `pretrain plan` prints it,
`pretrain train --gpu-type T` and train.micro_batch_size=auto apply it (docs/performance.md).

Rule: the largest micro-batch (a divisor of the sequences each rank handles per step) whose estimate
fits 90% of the device in the parallel mode the trainer would run; if none fits, the same search with
activation checkpointing on; if still none, the layout does not fit.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

from app.config import Config
from app.errors import RestartSmaller, UserError
from app.files import atomic_write_json
from app.gpus import normalize
from app.trainer.parallel.memory import GB, GPU_MEMORY_GB, HEADROOM, choose, estimates


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
        fits = (
            f"{self.gb_per_gpu:.0f} of {self.device_gb:.0f} GB per GPU"
            if self.device_gb
            else "as checkpointed"
        )
        return f"{head}: micro-batch {self.micro_batch} x accumulation {self.accum} per rank, {self.mode.upper()}{ac}, {fits}"


def fit(cfg: Config, gpu_type: str, gpus: int) -> Layout:
    """The layout for `gpus` GPUs of `gpu_type` (model.vocab_size must be set)."""
    key = normalize(gpu_type)
    if key not in GPU_MEMORY_GB:
        raise UserError(
            f"unknown GPU type '{gpu_type}' for a batch layout; use one of: {', '.join(GPU_MEMORY_GB)}"
        )
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    return fit_memory(cfg, gpus, int(GPU_MEMORY_GB[key] * GB), True, key)


def fit_memory(cfg: Config, gpus: int, device: int, cuda: bool, name: str, at_most: int = 0) -> Layout:
    """The rule above for `gpus` devices of `device` bytes; `at_most` caps the micro-batch (an earlier
    out-of-memory error)."""
    seq = cfg.model.seq_len
    t = cfg.train
    if t.batch_tokens:
        if t.batch_tokens % (seq * gpus):
            raise UserError(
                f"train.batch_tokens={t.batch_tokens} does not split over {gpus} GPUs x seq {seq}; "
                f"use a multiple of {seq * gpus}"
            )
        per_rank = t.batch_tokens // (seq * gpus)
        micros = [d for d in range(per_rank, 0, -1) if per_rank % d == 0 and d <= (at_most or d)]
    else:
        per_rank = t.micro_batch_size  # no global batch fixed: keep the micro-batch, no accumulation
        micros = [per_rank]
    trial = copy.deepcopy(cfg)
    trial.train.device_memory_gb = device / GB
    for checkpointing in [t.activation_checkpointing] + ([] if t.activation_checkpointing else [True]):
        trial.train.activation_checkpointing = checkpointing
        for micro in micros:
            trial.train.micro_batch_size = micro
            est = estimates(trial, gpus, cuda=cuda)
            mode, _ = choose(t.parallel, est["ddp"], est["fsdp"], device, gpus)
            need = est[mode].total
            if need <= device * HEADROOM:
                return Layout(
                    name, gpus, micro, per_rank // micro, mode, checkpointing, need / GB, device / GB
                )
    return Layout(name, gpus, 0, 0, t.parallel, True, 0.0, device / GB)


def auto_micro_batch(cfg: Config, world_size: int, device, keep: int = 0, at_most: int = 0) -> Layout:
    """train.micro_batch_size=auto for this run: `keep` (the resumed checkpoint's micro-batch: a resume
    keeps its layout) while it still divides each rank's share of train.batch_tokens; else the rule above
    for this device's memory (CUDA: the GPU's; CPU: this machine's, shared by its ranks)."""
    from app.trainer.parallel.memory import device_memory_bytes, host_memory_bytes

    per_rank = cfg.train.batch_tokens // (cfg.model.seq_len * world_size)
    cuda = getattr(device, "type", device) == "cuda"
    if keep and per_rank % keep == 0 and per_rank * cfg.model.seq_len * world_size == cfg.train.batch_tokens:
        return Layout(
            "ranks (resumed)",
            world_size,
            keep,
            per_rank // keep,
            cfg.train.parallel,
            cfg.train.activation_checkpointing,
            0.0,
            0.0,
        )
    have, _ = device_memory_bytes(cfg, device)
    if have is None:
        have = host_memory_bytes() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return fit_memory(cfg, world_size, have, cuda, "GPU" if cuda else "CPU", at_most)


def apply(cfg: Config, layout: Layout) -> None:
    """Set the config to the layout (the trainer then derives the accumulation from batch_tokens)."""
    if not layout.fits:
        raise UserError(
            f"{layout.describe()}; use more GPUs, a GPU with more memory, or a smaller train.batch_tokens"
        )
    cfg.train.micro_batch_size = layout.micro_batch
    cfg.train.activation_checkpointing = layout.checkpointing
    if layout.device_gb:  # a layout kept from a checkpoint measured nothing: the config keeps its own
        cfg.train.device_memory_gb = layout.device_gb


OOM_RECORD = "oom.json"  # in the run dir: the micro-batch an out-of-memory error left (auto only)


def for_run(cfg: Config, world_size: int, device, resumed, run_dir: Path | None, log) -> bool:
    """train.micro_batch_size=auto at start (False: a fixed micro-batch): a resume keeps its checkpoint's
    micro-batch; else the largest that fits, at most what an earlier out-of-memory error recorded. Applied
    to `cfg` (an int from here on, so the checkpoint records it)."""
    if cfg.train.micro_batch_size != "auto":
        return False
    saved = (resumed.meta.get("config") or {}) if resumed is not None else {}
    keep = (saved.get("train") or {}).get("micro_batch_size")
    record = run_dir / OOM_RECORD if run_dir else None
    at_most = json.loads(record.read_text())["micro_batch_size"] if record and record.is_file() else 0
    chosen = auto_micro_batch(cfg, world_size, device, keep if isinstance(keep, int) else 0, at_most)
    apply(cfg, chosen)
    log(f"batch layout (train.micro_batch_size=auto): {chosen.describe()}")
    return True


def smaller_micro_batch(cfg: Config, world_size: int) -> int:
    """At most half the micro-batch, still a divisor of each rank's sequences per step when
    train.batch_tokens fixes them (0: none is left)."""
    t = cfg.train
    per_rank = t.batch_tokens // (cfg.model.seq_len * world_size) if t.batch_tokens else 0
    return next((d for d in range(t.micro_batch_size // 2, 0, -1) if not per_rank or per_rank % d == 0), 0)


def halve_after_oom(cfg: Config, env, run_dir: Path, warn, step: int) -> int:
    """The next smaller micro-batch after an out-of-memory error at optimizer step `step` (0-based; 0: no
    smaller one), recorded for the next start. With several ranks (`env`) the error leaves a collective
    half-done that cannot be unwound: RestartSmaller (exit 145, retryable), and the restart uses it."""
    t = cfg.train
    smaller = smaller_micro_batch(cfg, env.world_size)
    if smaller:
        atomic_write_json(run_dir / OOM_RECORD, {"micro_batch_size": smaller})
        warn(
            f"out of memory at micro-batch {t.micro_batch_size}: from now on at most {smaller} "
            f"({run_dir / OOM_RECORD})"
        )
    if smaller and env.world_size > 1:
        why = f"out of memory at micro-batch {t.micro_batch_size} (step {step + 1}): restarting at micro-batch {smaller}"
        from app.trainer.parallel import distributed as peers

        peers.restarting_smaller(why)  # before this rank leaves its peers in a collective
        raise RestartSmaller(why)
    return smaller


def oom_drill(limit: int, rank: str = ""):
    """drill.oom_above: a forward hook that fails like a full GPU on training micro-batches above
    `limit` sequences (tests the auto fallback on a CPU; evaluation, without gradients, needs far less
    memory and passes). It fails after the forward, as a real one does mid-step: the blocks have run (and
    compiled, with train.compile) at the size that does not fit. drill.oom_rank fails that rank alone."""
    this_rank = rank in ("", os.environ.get("RANK", "0"))

    def hook(module, args, _output):
        import torch

        if module.training and args[0].size(0) > limit and this_rank:
            raise torch.OutOfMemoryError(f"injected: micro-batch {args[0].size(0)} > {limit}")

    return hook
