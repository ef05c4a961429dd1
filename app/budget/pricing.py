"""GPU prices and peaks: what a GPU-hour costs and what it computes, so static spend and plans need no API.

Prices are approximate on-demand USD per GPU-hour from public GPU-cloud list prices (2025); they drift
and differ per provider, so `--price-per-gpu-hour` or a price table file (`budget.price_table`) wins.
Peaks are dense bf16 TFLOP/s per GPU (no sparsity); app.trainer.metrics.PEAK_TFLOPS is preferred when it has the
type, so the trainer's MFU and the planner agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from app.budget.config import BudgetConfig, is_amount
from app.errors import UserError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    price_per_gpu_hour: float  # USD, approximate on-demand
    peak_tflops: float  # dense bf16 TFLOP/s


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("a100-40gb", 1.29, 312.0),
        GpuSpec("a100-80gb", 1.79, 312.0),
        GpuSpec("h100-pcie", 2.49, 756.0),
        GpuSpec("h100-sxm", 2.99, 989.0),
        GpuSpec("h200", 3.79, 989.0),
        GpuSpec("b200", 5.99, 2250.0),
        GpuSpec("l40s", 0.99, 362.0),
    )
}

ALIASES = {
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb",
    "a100-80gb-pcie": "a100-80gb",
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-80gb-hbm3": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h200-141gb": "h200",
    "h200-sxm": "h200",
}


def normalize(gpu_type: str) -> str:
    """'NVIDIA A100-SXM4-80GB', 'A100_80GB' -> a table key when one matches, else the cleaned name."""
    key = re.sub(r"[\s_]+", "-", gpu_type.strip().lower()).removeprefix("nvidia-")
    return ALIASES.get(key, key)


def detect_cuda_gpu_type() -> str:
    """The table key of the local CUDA device (e.g. 'NVIDIA H100 80GB HBM3' -> h100-sxm), or "" (CPU,
    unknown model, or torch missing)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return ""
        n = torch.cuda.get_device_name(0).lower()
    except Exception:
        return ""
    if "b200" in n:
        return "b200"
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-sxm"
    if "a100" in n:
        return "a100-40gb" if "40gb" in n else "a100-80gb"
    if "l40s" in n:
        return "l40s"
    return ""


def resolve_gpus(cfg: BudgetConfig, world_size: int) -> int:
    """GPUs billed: the config, else the world size on GPUs, else 1 (a CPU box bills as one unit)."""
    if cfg.gpus > 0:
        return cfg.gpus
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    return max(1, world_size) if cuda else 1


def load_price_table(path: str) -> dict[str, float]:
    """A user's prices: {gpu_type: price} or {gpu_type: {price_per_gpu_hour: P}}, JSON or YAML."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read price table {path}: {e.strerror}; fix budget.price_table") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError):
        raise UserError(
            f"price table {path} is not valid JSON/YAML; expected {{gpu_type: usd_per_gpu_hour}}"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"price table {path} must map GPU types to USD per GPU-hour, e.g. {{h100-sxm: 2.5}}")
    out: dict[str, float] = {}
    for key, val in data.items():
        if isinstance(val, dict):
            val = val.get("price_per_gpu_hour")
        if not is_amount(val):
            raise UserError(f"price table {path}: price for '{key}' must be a number >= 0, got {val!r}")
        out[normalize(str(key))] = float(val)
    return out


def price_per_gpu_hour(gpu_type: str, override: float = 0.0, table_path: str = "") -> float:
    """USD per GPU-hour: the override, else the user's table, else the built-in one; 0 when unknown."""
    if override > 0:
        return override
    key = normalize(gpu_type)
    if key and table_path and key in (table := load_price_table(table_path)):
        return table[key]
    spec = GPUS.get(key)
    return spec.price_per_gpu_hour if spec else 0.0


def peak_tflops(gpu_type: str) -> float:
    """Dense bf16 TFLOP/s per GPU from app.trainer.metrics.PEAK_TFLOPS when it knows the type, else this table."""
    key = normalize(gpu_type)
    try:
        from app.trainer.metrics import PEAK_TFLOPS  # the trainer's table, when it exists

        for name in (gpu_type, key, key.upper()):
            if name in PEAK_TFLOPS:
                return float(PEAK_TFLOPS[name])
    except ImportError:
        pass
    spec = GPUS.get(key)
    return spec.peak_tflops if spec else 0.0


def known_types() -> str:
    return ", ".join(GPUS)


def static_rate(
    cfg_gpu_type: str, price_override: float, gpus: int, table_path: str = ""
) -> tuple[float, float]:
    """(USD per hour for all billed GPUs, USD per GPU-hour); (0, 0) when no price is known."""
    price = price_per_gpu_hour(cfg_gpu_type, price_override, table_path)
    return price * max(gpus, 1), price


def no_price_error(gpu_type: str) -> UserError:
    what = f"GPU type '{gpu_type}'" if gpu_type else "this machine (CPU or an unknown GPU)"
    return UserError(
        f"no price for {what}: pass --price-per-gpu-hour P (budget.price_per_gpu_hour) "
        f"or a GPU type (--gpu-type / budget.gpu_type), one of: {known_types()}"
    )
