"""What a GPU-hour costs and what it computes, so static spend and plans need no API: the built-in
prices and peaks are app/gpus.py's table (the trainer's MFU reads the same peaks, so it and the planner
agree).

Prices are approximate on-demand list prices (2025): they drift and differ per provider, so
`--price-per-gpu-hour` or a price table file (`budget.price_table`) wins.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from app.budget.files import is_amount
from app.config.budget import BudgetConfig
from app.errors import UserError
from app.gpus import GPUS, key_of, known, normalize, priced


def detect_cuda_gpu_type() -> str:
    """The GPUS key of the local CUDA device (e.g. 'NVIDIA H100 80GB HBM3' -> h100-sxm), or "" (CPU,
    unknown model, or torch missing)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return ""
        name = torch.cuda.get_device_name(0)
    except Exception:
        return ""
    return key_of(name)


def resolve_gpus(cfg: BudgetConfig, world_size: int) -> int:
    """GPUs billed: the config, else the world size on GPUs, else 1 (a CPU box bills as one unit)."""
    if cfg.gpus > 0:
        return cfg.gpus
    import torch  # a dependency; imported here so the sidecar's start-up does not pay for it

    return max(1, world_size) if torch.cuda.is_available() else 1


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
    row = GPUS.get(key)
    return row.price if row is not None and row.price is not None else 0.0


def peak_tflops(gpu_type: str) -> float:
    """Dense bf16 TFLOP/s per GPU; 0 when unknown."""
    row = known(gpu_type)
    return row.peak_tflops if row is not None else 0.0


def known_types() -> str:
    """The GPU types with a built-in price."""
    return ", ".join(priced())


def local_price(cfg: BudgetConfig, world_size: int) -> tuple[str, int, float]:
    """(GPU type, GPUs billed, USD per GPU-hour; 0 when unknown) of this run, on this machine."""
    gpu_type = cfg.gpu_type or detect_cuda_gpu_type()
    price = price_per_gpu_hour(gpu_type, cfg.price_per_gpu_hour, cfg.price_table)
    return gpu_type, resolve_gpus(cfg, world_size), price


def static_rate(
    cfg_gpu_type: str, price_override: float, gpus: int, table_path: str = ""
) -> tuple[float, float]:
    """(USD per hour for all billed GPUs, USD per GPU-hour); (0, 0) when no price is known."""
    price = price_per_gpu_hour(cfg_gpu_type, price_override, table_path)
    return price * max(gpus, 1), price


def no_price_error(gpu_type: str) -> UserError:
    if gpu_type and known(gpu_type):  # app/gpus.py knows its peak, not a price
        what = f"GPU type '{gpu_type}' (no built-in price)"
    else:
        what = f"GPU type '{gpu_type}'" if gpu_type else "this machine (CPU or an unknown GPU)"
    return UserError(
        f"no price for {what}: pass --price-per-gpu-hour P (budget.price_per_gpu_hour) "
        f"or a GPU type (--gpu-type / budget.gpu_type), one of: {known_types()}"
    )
