"""FP8 training (train.fp8=true) with torchao's float8 linear layers. Untested here: no GPU in CI.

Why torchao and not TransformerEngine: torchao swaps nn.Linear for Float8Linear in place (same parameter
names, same fp32 master weights, same checkpoints), composes with FSDP2 and torch.compile, and needs no
change to the training step; TransformerEngine needs its own modules and an fp8_autocast context around
every forward. The NGC PyTorch image is not checked here for torchao: when it is missing, the flag
refuses with the fix (`pip install torchao`).

Dynamic tensorwise scaling (torchao's default recipe). The output head stays in bf16 (logits are
sensitive and, for small vocabularies, too narrow), as does any layer whose sizes are not multiples of
16 (an FP8 GEMM requirement). Best compiled (train.compile: auto is on for CUDA), which fuses the casts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have FP8 tensor cores


def check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(
            "train.fp8=true needs an FP8-capable GPU (H100-class, compute capability >= 8.9); "
            "this run is on CPU: remove train.fp8"
        )
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.fp8=true needs compute capability >= 8.9 (H100-class); {name} is "
            f"{cap[0]}.{cap[1]}: remove train.fp8"
        )


def _fp8_ok(module: torch.nn.Module, fqn: str) -> bool:
    if fqn == "head" or fqn.endswith(".head"):
        return False
    return (
        isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
    )


def convert_to_fp8(model: torch.nn.Module, device: torch.device, log: Callable[[str], None] = print) -> int:
    """Swap the eligible nn.Linear layers for torchao Float8Linear, in place; returns how many."""
    check_fp8_device(device)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            "train.fp8=true needs torchao, which this image does not have: pip install torchao"
        ) from None
    before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=_fp8_ok)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    log(f"fp8: {converted} of {before} linear layers run in float8 (torchao)")
    return converted
