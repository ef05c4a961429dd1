"""The processes of a run and how they agree.

Ranks agree in one way only: `agree`, an all-reduce of a small host tensor over gloo. Under NCCL that is
a second process group (the control group), so a decision never waits for the GPU's queue to drain.
The loop's decisions (stop, save now, the budget decay), the resume checks and the barriers use the
control group; the checkpoint writer, which agrees from its own thread, uses a gloo group of its own
(collectives on one group must not interleave between threads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_CONTROL_GROUP = None


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node: str = "local"

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_local_rank0(self) -> bool:
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        agree([0])

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        return bool(agree([int(flag)], dist.ReduceOp.MIN)[0])


def agree(values: list[int], op=dist.ReduceOp.MAX, group=None) -> list[int]:
    """Collective: the element-wise `op` of `values` over all ranks (the control group by default)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group or _CONTROL_GROUP)
    return t.tolist()


def init_distributed(device_type: str, timeout_minutes: float = 30.0) -> DistEnv:
    """Read torchrun's environment; join the process group (gloo on CPU, NCCL on CUDA) and, under NCCL,
    the gloo control group. The timeout bounds every collective, so it must exceed the longest wait of
    one rank for another (a checkpoint commit, the step-0 eval): train.collective_timeout_minutes."""
    global _CONTROL_GROUP
    world = int(os.environ.get("WORLD_SIZE", "1"))
    env = DistEnv(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        node=os.environ.get("NODE_NAME") or os.environ.get("HOSTNAME") or "local",
    )
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, timeout=timeout)
        _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return env


def shutdown_distributed() -> None:
    global _CONTROL_GROUP
    _CONTROL_GROUP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a device tensor over ranks (data, not a decision: it goes over the main group)."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
