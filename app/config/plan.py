"""The GPUs a config is made for (`plan:`): what the planning commands assume when told nothing else."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlanConfig:
    """The GPUs a config is made for. `--print-config` (and the memory estimate it prints) plans for them as
    for --gpus N --gpu-type T when the command line and config name no GPUs, and `pretrain plan --preset`
    marks their row; a run trains on the GPUs it is launched on."""

    gpus: int = 0  # GPUs the config is made for, all nodes together; 0 = none: plan for this machine
    gpu_type: str = ""  # their type, a key of the GPU table (b200, h100-sxm, a100-80gb, ...); "" = none
