"""The torch features the code uses, the first torch release with each, and the NGC base that has them all:
one record for the image build, scripts/ngc_standin.sh (reads BASE without torch: no torch import here),
tests/test_dockerfile.py and the trainer's start-up (`require`: one line, exit 2). Probes ask the running
torch, not its version string (NGC ships pre-releases such as 2.10.0a0).

Also the torchao that train.fp8 needs for a given torch (`python features.py torchao TORCH_VERSION`, which
the image build runs before the project is copied): the NGC base has no torchao, and torchao publishes no
torch requirement, so the pair is chosen here."""

from __future__ import annotations

import importlib
import re
import sys

# NGC PyTorch release notes, 25.12: torch 2.10 (>= 2.9, so torch.optim.Muon), CUDA 13.1, Python 3.12.
BASE = {
    "image": "nvcr.io/nvidia/pytorch:25.12-py3",
    "torch": "2.10.0a0+b4e4ee81d3",
    "cuda": "13.1.0",
    "python": "3.12",
}


# torch minor -> the torchao release built against it (torchao's compatibility table; from 0.17 torchao is
# ABI-stable for torch >= 2.11). Newer torch: the newest row, which pyproject's fp8 extra pins too.
TORCHAO = {"2.10": "0.16.0", "2.11": "0.17.0", "2.12": "0.18.0"}


def torchao_for(torch_version: str) -> str:
    """The pip requirement of the torchao for this torch (e.g. '2.10.0a0+b4e4ee81d3' -> 'torchao==0.16.0')."""
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", torch_version).groups())
    known = sorted(TORCHAO, key=lambda v: tuple(int(p) for p in v.split(".")))
    oldest, newest = known[0], known[-1]
    if (major, minor) < tuple(int(p) for p in oldest.split(".")):
        raise SystemExit(f"torch {torch_version} is older than the base's; no torchao chosen for it")
    key = f"{major}.{minor}" if f"{major}.{minor}" in TORCHAO else newest
    return f"torchao=={TORCHAO[key]}"


def _sdpa_gqa(cfg) -> bool:
    import torch

    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def _compile_mode(cfg) -> bool:
    import torch._inductor

    modes = getattr(torch._inductor, "list_mode_options", dict)()  # torch 2.0 had none
    return cfg.train.compile_mode == "default" or cfg.train.compile_mode in modes


def _torchao(cfg) -> bool:
    from app.trainer.parallel.fp8 import load_float8

    return load_float8() is not None


# (feature, first torch release with it (None: a package), which runs need it, probe: (module, attribute)
# or a function of the config, the fix other than an upgrade)
FEATURES = [
    ("torch.optim.Muon", "2.9", "muon", ("torch.optim", "Muon"), "use optim.name=adamw"),
    ("scaled_dot_product_attention(enable_gqa=...)", "2.5", "all", _sdpa_gqa, ""),
    (
        "FSDP2 fully_shard in torch.distributed.fsdp",
        "2.6",
        "fsdp",
        ("torch.distributed.fsdp", "fully_shard"),
        "use train.parallel=ddp",
    ),
    ("public DTensor (torch.distributed.tensor)", "2.5", "all", ("torch.distributed.tensor", "DTensor"), ""),
    ("torch.compiler.set_stance", "2.6", "all", ("torch.compiler", "set_stance"), ""),
    (
        "torch.compile mode max-autotune-no-cudagraphs",
        "2.1",
        "compile",
        _compile_mode,
        "use train.compile_mode=default",
    ),
    ("torchao's float8 training (the torchao package)", None, "fp8", _torchao, "remove train.fp8"),
]


def present(probe, cfg) -> bool:
    if callable(probe):
        return probe(cfg)
    try:
        return hasattr(importlib.import_module(probe[0]), probe[1])
    except ImportError:
        return False


def require(cfg, fsdp: bool, compiled: bool) -> None:
    """Refuse, in one line, a run that needs a feature this torch (or its packages) lacks."""
    import torch

    from app.errors import ConfigError
    from app.trainer.parallel.fp8 import fp8_mode

    runs = {
        "all": True,
        "muon": cfg.optim.name == "muon",
        "fsdp": fsdp,
        "compile": compiled,
        "fp8": fp8_mode(cfg.train.fp8) != "false",
    }
    for name, first, needed_by, probe, fix in FEATURES:
        if not runs[needed_by] or present(probe, cfg):
            continue
        if first is None:
            raise ConfigError(f"this run needs {name}, which is not installed: pip install torchao, or {fix}")
        upgrade = f"use torch >= {first} (the image's base {BASE['image']} has {BASE['torch']})"
        raise ConfigError(
            f"this run needs {name}, which torch {torch.__version__} lacks: {upgrade}"
            + (fix and f", or {fix}")
        )


if __name__ == "__main__":  # the image build: `python features.py torchao 2.10.0a0` -> torchao==0.16.0
    if len(sys.argv) != 3 or sys.argv[1] != "torchao":
        raise SystemExit("usage: python features.py torchao TORCH_VERSION")
    print(torchao_for(sys.argv[2]))
