"""What the machine decides for the loop: the device and its math settings, the autocast dtype, and how
one optimizer step's batch is laid out over ranks and micro-batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

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


def compile_enabled(cfg, device: torch.device) -> bool:
    """train.compile=auto: on for CUDA (where fused kernels pay), off for CPU (compile time dominates)."""
    from app.trainer.parallel.memory import compiles

    return compiles(cfg, device.type == "cuda")


def compile_mode_for(mode: str, fsdp: bool, log: Callable[[str], None] = print) -> str:
    """max-autotune captures CUDA graphs, which FSDP2's per-block gathers and frees break: under FSDP the
    same autotuning without graphs."""
    if fsdp and mode == "max-autotune":
        log("compile: max-autotune-no-cudagraphs, not max-autotune (its CUDA graphs break FSDP2's gathers)")
        return "max-autotune-no-cudagraphs"
    return mode


def residual_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """train.activation_dtype: the residual stream's dtype under bf16 autocast (GPT.residual_dtype). auto
    is bf16 there, as in the record and nanochat: the stream, the norms' inputs and outputs and the adds
    move half the bytes (fp32 master weights and the fp32 loss stay). None where nothing runs in bf16."""
    want = cfg.train.activation_dtype
    if not isinstance(autocast_for(cfg, device), torch.autocast):
        if want == "bf16":
            raise ConfigError(
                "train.activation_dtype=bf16 needs bf16 compute: set train.dtype=bf16 (auto is bf16 on CUDA "
                f"only, this run is on {device.type}), or train.activation_dtype=auto"
            )
        return None
    return torch.float32 if want == "fp32" else torch.bfloat16


def fused_projections(cfg: Config, device: torch.device) -> bool:
    """train.fused_projections: q/k/v and gate/up as one matmul each. auto = with train.compile: eager on a
    CPU it is slower (0.92x: the backward concatenates the outputs' gradients, a copy wider than the
    inputs' gradient sum it saves; docs/performance.md), compiled on a GPU the larger GEMMs pay."""
    from app.trainer.parallel.memory import compiles

    want = cfg.train.fused_projections
    return want == "true" or (want == "auto" and compiles(cfg, device.type == "cuda"))


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
    from app.trainer.optimization.optimizer import fused_adamw
    from app.trainer.parallel.memory import plan, planned_world_size

    t, o = cfg.train, cfg.optim
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = isinstance(autocast_for(cfg, device), torch.autocast)  # its only autocast is bf16
    fused = fused_adamw(o, device)
    compiled = compile_enabled(cfg, device)
    why: list[str] = []  # the trainer's own log line when the mode that runs is not the configured one
    fsdp = plan(cfg, planned_world_size(cfg), cuda=cuda).mode == "fsdp"
    mode = compile_mode_for(t.compile_mode, fsdp, why.append)
    mode = why[0].removeprefix("compile: ") + " under FSDP" if why else mode
    residual = "bf16" if residual_dtype(cfg, device) == torch.bfloat16 else "fp32"
    projections = "one matmul for q/k/v and one for gate/up" if fused_projections(cfg, device) else "separate"
    return [
        f"# runtime ({device.type}): "
        + ("bf16 autocast over fp32 master weights" if bf16 else "fp32")
        + ("; TF32 for fp32 matmuls (float32_matmul_precision=high)" if cuda else ""),
        f"# activations: {residual} residual stream (train.activation_dtype={t.activation_dtype}); "
        f"projections {projections} (train.fused_projections={t.fused_projections})",
        f"# optimizer: {'Muon + ' if o.name == 'muon' else ''}{'fused' if fused else 'foreach'} AdamW; a "
        f"non-finite step is {'skipped on the device' if fused else 'checked on the host'}",
        "# attention: scaled_dot_product_attention"
        + (" (flash / memory-efficient kernels)" if cuda else "")
        + ("; GQA without repeating K/V" if cfg.model.kv_heads != cfg.model.n_head else ""),
        f"# compile: {'each transformer block and the loss, mode ' + mode if compiled else 'off'} "
        f"(train.compile={t.compile}; auto = on for CUDA)"
        + ("; the embedding and value-table lookups too" if compiled else ""),
        f"# data: {t.prefetch} micro-batches read ahead on a side thread"
        + (" into pinned memory, copied without blocking" if cuda else "")
        if t.prefetch
        else "# data: read in the loop (train.prefetch=0)",
        f"# host syncs: none in the step; its numbers are read every train.log_every={t.log_every} steps"
        + ("; train.skip_spike_updates reads every step" if t.skip_spike_updates else "")
        + "; the stop agreement runs over gloo on the host",
        f"# collectives: timeout {t.collective_timeout_minutes:g} min (train.collective_timeout_minutes)",
    ]
