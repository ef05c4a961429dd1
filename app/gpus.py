"""What the project knows of each GPU type, in one table (GPUS): its dense bf16 peak (MFU, plans), its memory
as the driver reports it (batch layouts, parallel=auto, plans) and an approximate price (spend, plans),
and how a user or a CUDA device names it (`normalize`). One row per type, so a GPU added for one purpose
is known to the others; a fact not known is None, and the tool that needs it says so in one line.

No torch import: the budget sidecar reads prices without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    peak_tflops: float  # dense bf16, vendor datasheet (half the "with sparsity" figure)
    # torch.cuda.mem_get_info's total on it, GB = 1e9 bytes (an "80GB" H100 has 80 GiB of HBM, about 85 GB),
    # so that a plan and a run's train.micro_batch_size=auto, which asks the device, pick the same micro-batch
    memory_gb: float | None
    price: (
        float | None
    )  # USD per GPU-hour, approximate on-demand (2025; providers differ); None: no list price


GPUS: dict[str, GPU] = {
    "a100-40gb": GPU(312.0, 42.3, 1.29),
    "a100-80gb": GPU(312.0, 85.0, 1.79),
    "a800": GPU(312.0, 85.0, None),
    "a10": GPU(125.0, 23.7, None),  # 24 GB GDDR6, as the L4
    "h100-sxm": GPU(989.0, 85.0, 2.99),
    "h100-pcie": GPU(756.0, 85.0, 2.49),
    "h100-nvl": GPU(835.0, 100.0, None),
    "h800": GPU(989.0, 85.0, None),  # the SXM H100's compute with less NVLink bandwidth
    "h800-pcie": GPU(756.0, 85.0, None),  # 80 GB, as the H100 PCIe
    "h20": GPU(148.0, None, None),
    "h200": GPU(989.0, 150.0, 3.79),
    "h200-nvl": GPU(835.0, 150.0, None),
    "gh200": GPU(989.0, None, None),  # 96 or 144 GB by model
    "b100": GPU(1750.0, 191.0, None),  # 192 GB HBM3e, as the B200
    "b200": GPU(2250.0, 191.0, 5.99),
    "gb200": GPU(2500.0, None, None),
    "l4": GPU(121.0, 23.7, None),
    "l40": GPU(181.0, 47.7, None),  # 48 GB GDDR6, as the L40S
    "l40s": GPU(362.0, 47.7, 0.99),
}

# A name (cleaned: lower case, '-' for spaces and '_', no 'nvidia-') -> its row: the first pattern that
# matches wins, so the variants (NVL, PCIe, 40GB, and GH200 / GB200, which contain other names) come
# before their base names. Covers CUDA device names ('NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-40GB')
# and the short names users type ('h100', 'a100').
NAMES = (
    (r"gh200", "gh200"),
    (r"gb200", "gb200"),
    (r"h200.*nvl", "h200-nvl"),
    (r"h200", "h200"),
    (r"h100.*nvl", "h100-nvl"),
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "h100-sxm"),
    (r"h800.*pcie", "h800-pcie"),
    (r"h800", "h800"),
    (r"\bh20\b", "h20"),
    (r"b200", "b200"),
    (r"b100", "b100"),
    (r"a100.*40gb", "a100-40gb"),
    (r"a100", "a100-80gb"),
    (r"a800", "a800"),
    (r"l40s", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\ba10\b", "a10"),
)


def normalize(name: str) -> str:
    """'NVIDIA H100 80GB HBM3', 'A100_80GB', 'h100' -> the GPUS key, else the cleaned name (a type the table
    does not know, e.g. one a user's price table names)."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower()).removeprefix("nvidia-")
    if key in GPUS:
        return key
    return next((row for pattern, row in NAMES if re.search(pattern, key)), key)


def key_of(name: str) -> str:
    """The GPUS key of a name (a CUDA device's, e.g. 'NVIDIA H100 NVL', or a user's), or '' for a GPU the
    table does not know."""
    key = normalize(name)
    return key if key in GPUS else ""


def known(name: str) -> GPU | None:
    """The row of a GPU type as a user or a CUDA device names it, or None."""
    return GPUS.get(normalize(name))


def with_memory() -> dict[str, float]:
    """GB of each type whose memory is known (layouts and plans for a GPU not at hand)."""
    return {key: gpu.memory_gb for key, gpu in GPUS.items() if gpu.memory_gb}


def priced() -> list[str]:
    """The types with a built-in price."""
    return [key for key, gpu in GPUS.items() if gpu.price is not None]
