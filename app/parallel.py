"""Process group setup and model wrapping (DDP today; FSDP plugs in here), plus the state-dict
accessors the checkpoint code uses so it never needs to know how the model is wrapped."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
        if self.distributed:
            dist.barrier()


def init_distributed(device_type: str) -> DistEnv:
    """Read torchrun's environment; join the process group (gloo on CPU, NCCL on CUDA)."""
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
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    return env


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, env: DistEnv, device: torch.device) -> torch.nn.Module:
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return getattr(model, "module", model)  # DDP


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return unwrap(model).state_dict()


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return optimizer.state_dict()


def load_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict | None
) -> None:
    unwrap(model).load_state_dict(model_state)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
