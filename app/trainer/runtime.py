"""What the machine decides for the loop: the device and its math settings, the autocast dtype, and how
one optimizer step's batch is laid out over ranks and micro-batches."""

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


def configure_device(device: torch.device) -> None:
    """CUDA: TF32 for the fp32 matmuls left outside autocast (the optimizer's, the loss's) and cuDNN."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")


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


def describe(cfg: Config, cuda: bool) -> list[str]:
    """What the loop does on this device, for --print-config (as YAML comments): each line asks the
    function that makes the decision in the trainer."""
    from app.trainer.memory import plan, planned_world_size
    from app.trainer.optim import fused_adamw
    from app.trainer.parallelize import compile_enabled, compile_mode_for

    t, o = cfg.train, cfg.optim
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = isinstance(autocast_for(cfg, device), torch.autocast)  # its only autocast is bf16
    fused = fused_adamw(o, device)
    compiled = compile_enabled(cfg, device)
    why: list[str] = []  # the trainer's own log line when the mode that runs is not the configured one
    fsdp = plan(cfg, planned_world_size(cfg), cuda=cuda).mode == "fsdp"
    mode = compile_mode_for(t.compile_mode, fsdp, why.append)
    mode = why[0].removeprefix("compile: ") + " under FSDP" if why else mode
    return [
        f"# runtime ({device.type}): "
        + ("bf16 autocast over fp32 master weights" if bf16 else "fp32")
        + ("; TF32 for fp32 matmuls (float32_matmul_precision=high)" if cuda else ""),
        f"# optimizer: {'Muon + ' if o.name == 'muon' else ''}{'fused' if fused else 'foreach'} AdamW; a "
        f"non-finite step is {'skipped on the device' if fused else 'checked on the host'}",
        "# attention: scaled_dot_product_attention"
        + (" (flash / memory-efficient kernels)" if cuda else "")
        + ("; GQA without repeating K/V" if cfg.model.kv_heads != cfg.model.n_head else ""),
        f"# compile: {'each transformer block and the loss, mode ' + mode if compiled else 'off'} "
        f"(train.compile={t.compile}; auto = on for CUDA)",
        f"# data: {t.prefetch} micro-batches read ahead on a side thread"
        + (" into pinned memory, copied without blocking" if cuda else "")
        if t.prefetch
        else "# data: read in the loop (train.prefetch=0)",
        f"# host syncs: none in the step; its numbers are read every train.log_every={t.log_every} steps"
        + ("; train.skip_spike_updates reads every step" if t.skip_spike_updates else "")
        + "; the stop agreement runs over gloo on the host",
        f"# collectives: timeout {t.collective_timeout_minutes:g} min (train.collective_timeout_minutes)",
    ]
