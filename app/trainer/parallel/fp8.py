"""FP8 training with torchao's float8 linear layers: train.fp8=true on H100-class GPUs, train.fp8=emulate
anywhere (torchao's emulation: the same scaling and float8 rounding, the matmul in software; what CI runs).
docs/parallel.md ("FP8") says why torchao and not TransformerEngine. The output head stays in bf16 (logits
are sensitive), as does any layer whose sizes are not multiples of 16 (an FP8 GEMM requirement), and so
does the ReLU² MLP's w_down: its input relu(x)² squares the spread of the activations' magnitudes, and
tensorwise scaling sets one scale for the whole tensor from its largest value, so the quiet tokens' inputs
fall below e4m3's smallest steps and their outputs are lost (tests/test_fp8.py measures it;
docs/performance.md, "FP8: when it pays").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from app.config.checks import _switch
from app.errors import ConfigError

MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have FP8 tensor cores


def fp8_mode(value) -> str:
    """train.fp8 as YAML may give it (a bool, or a string): false | true | emulate."""
    mode = _switch(str(value))
    if mode not in ("false", "true", "emulate"):
        raise ConfigError(f"train.fp8='{value}' is not valid; choose one of: false, true, emulate")
    return mode


def check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(
            "train.fp8=true needs an FP8-capable GPU (H100-class, compute capability >= 8.9); "
            "this run is on CPU: remove train.fp8 (or train.fp8=emulate to test the FP8 path)"
        )
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.fp8=true needs compute capability >= 8.9 (H100-class); {name} is "
            f"{cap[0]}.{cap[1]}: remove train.fp8"
        )


def _fp8_ok(module: torch.nn.Module, fqn: str, relu2: bool = False) -> bool:
    if fqn == "head" or fqn.endswith(".head"):
        return False
    if relu2 and fqn.endswith("mlp.w_down"):  # relu(x)^2 in: module docstring
        return False
    return (
        isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
    )


def load_float8():
    """torchao.float8, or None without torchao. On a CPU build of torch its import logs that its CUDA
    kernels did not load (and torch a deprecation): nothing here needs those, so they are not shown."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torchao.float8
    except ImportError:
        return None
    return torchao.float8


def convert_to_fp8(
    model: torch.nn.Module,
    device: torch.device,
    log: Callable[[str], None] = print,
    mode: str = "true",
    fsdp: bool = False,
) -> int:
    """Swap the eligible nn.Linear layers for torchao Float8Linear, in place; returns how many. Under FSDP2
    (`fsdp`) the weights are all-gathered in float8 (half the bytes of bf16) with scales computed once per
    step for all of them after the optimizer step (`scale_after_step`), as torchao and torchtitan do."""
    if mode != "emulate":
        check_fp8_device(device)
    float8 = load_float8()
    before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    relu2 = getattr(getattr(model, "cfg", None), "mlp", "") == "relu2"
    config = float8.Float8LinearConfig(emulate=mode == "emulate", enable_fsdp_float8_all_gather=fsdp)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: _fp8_ok(m, fqn, relu2)
    )
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    emulated = ", emulated" if mode == "emulate" else ""
    kept = "; mlp.w_down stays out of float8 (its input relu(x)^2 spans too wide a range for one scale)"
    kept = kept if relu2 else ""
    log(f"fp8: {converted} of {before} linear layers run in float8 (torchao{emulated}){kept}")
    return converted


def scale_after_step(model: torch.nn.Module):
    """An optimizer step post-hook that precomputes the float8 scales of every weight FSDP2 gathers in
    float8 (one all-reduce of their amaxes for all of them, not one per weight in the next forward), or
    None when the model has none."""
    gathered = [
        m
        for m in model.modules()
        if getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
    ]
    if not gathered:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda _optimizer, _args, _kwargs: precompute_float8_dynamic_scale_for_fsdp(model)
