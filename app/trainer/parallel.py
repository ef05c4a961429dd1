"""Process groups, model wrapping (DDP or FSDP2), activation checkpointing, and the state-dict seam the
checkpoint code uses, so it never needs to know how the model is wrapped.

Modes (train.parallel; `auto` is resolved by app.memory.plan before the model is built):

    ddp   every rank holds the whole model, gradients are all-reduced (DistributedDataParallel);
          one process: the plain model
    fsdp  torch.distributed.fsdp.fully_shard on every transformer block, then on the root: parameters,
          gradients and AdamW state are sharded over the ranks (fp32 master shards); on CUDA the blocks
          compute in bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), on CPU in fp32

State dicts are always *full* and keyed by parameter names (FQNs) in both modes, through
torch.distributed.checkpoint.state_dict: rank 0 gathers the full weights and optimizer state (on CPU), and
a load broadcasts them from rank 0 and re-shards them for whatever world size and mode is running now.
So checkpoints are interchangeable between DDP and FSDP and between world sizes, and model.safetensors
is always the full model for `pretrain sample` and `pretrain export`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

try:  # torch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - torch 2.4/2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

# Above this many bytes of fp32 weights an FSDP run on CPU also starts on the meta device (on CUDA it
# always does): each rank then never holds more than its shard.
META_INIT_CPU_BYTES = 4 << 30


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


# ---------------------------------------------------------------- building and wrapping


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block in backward instead of keeping its activations (non-reentrant,
    composable: parameter names do not change, so checkpoints do not either)."""
    from torch.distributed._composable import checkpoint

    for block in model.blocks:
        checkpoint(block)


def _mixed_precision(device: torch.device, dtype: str):
    if device.type == "cuda" and dtype in ("auto", "bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # fp32 compute and reduction (CPU, or train.dtype=fp32)


def _fsdp_no_sync() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def shard_model(model: torch.nn.Module, device: torch.device, dtype: str = "auto") -> torch.nn.Module:
    """FSDP2: fully_shard every block, then the root (embedding, final norm, head). In place.

    Gradient accumulation: FSDP reduce-scatters every micro-batch (keeping unsharded gradients around
    between micro-batches would cost a full copy of the gradients per GPU), so the DDP-style
    `model.no_sync()` the trainer calls is a no-op here."""
    mp = _mixed_precision(device, dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    object.__setattr__(model, "no_sync", _fsdp_no_sync)
    return model


def materialize(model: torch.nn.Module, device: torch.device, seed: int, rank: int) -> None:
    """Allocate a model built on the meta device (after sharding: only this rank's shards) and run the
    GPT init. On CUDA, DTensor's RNG tracker draws every shard from one global stream; on CPU it cannot,
    so each rank draws its shards from its own seed (still i.i.d. N(0, std): a valid init, but not the
    same numbers as an unsharded build)."""
    model.to_empty(device=device)
    gpt = unwrap(model)
    if device.type == "cuda":
        with torch.no_grad():
            gpt.reset_parameters()
        return
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1_000_003 * rank)
        gpt.reset_parameters()


def build_parallel_model(
    cfg,
    env: DistEnv,
    device: torch.device,
    mode: str,
    log: Callable[[str], None] = print,
    meta_init: bool | None = None,
) -> torch.nn.Module:
    """The GPT for `mode` (ddp | fsdp, already resolved from auto): optional FP8 layers, activation
    checkpointing per block, then DDP or FSDP. Returns the wrapped model; `unwrap()` gives the GPT.

    Deterministic: with the same torch seed, DDP and FSDP (built unsharded, then sharded) start from the
    same weights. `meta_init` (default: FSDP on CUDA, or weights above 4 GiB) builds on the meta device,
    shards, then materializes only the local shards."""
    from app.trainer.model import build_model

    fsdp = mode == "fsdp" and env.distributed
    if mode == "fsdp" and not env.distributed:
        log("train.parallel=fsdp with one process: nothing to shard, training unsharded")
    if meta_init is None:
        from app.trainer.memory import param_split

        meta_init = fsdp and (device.type == "cuda" or 4 * param_split(cfg.model).total > META_INIT_CPU_BYTES)
    meta_init = meta_init and fsdp
    model = build_model(cfg.model, "meta" if meta_init else device)
    if cfg.train.fp8:
        from app.trainer.fp8 import convert_to_fp8

        convert_to_fp8(model, device, log)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if fsdp:
        shard_model(model, device, cfg.train.dtype)
        if meta_init:
            materialize(model, device, cfg.train.seed, env.rank)
        return model
    return wrap_model(model, env, device)


def wrap_model(model: torch.nn.Module, env: DistEnv, device: torch.device) -> torch.nn.Module:
    """DDP (gradients as views into the all-reduce buckets: no second copy of the gradients)."""
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside torch.compile and DDP (an FSDP model is the GPT itself, sharded)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return getattr(model, "module", model)  # DDP


def is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


# ---------------------------------------------------------------- state dicts (full, FQN-keyed)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _broadcasting() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _tied_names(gpt: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied embeddings), first name first."""
    groups: dict[int, list[str]] = {}
    for name, p in gpt.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full weights on CPU on rank 0 ({} on other ranks). Tied names share one tensor,
    so the checkpoint stores it once."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    gpt = unwrap(model)
    state = get_model_state_dict(gpt, options=_options(cpu_offload=True))
    for names in _tied_names(gpt):
        present = [n for n in names if n in state]
        for alias in present[1:]:
            state[alias] = state[present[0]]
    return state


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """Collective: the full optimizer state on CPU on rank 0, keyed by parameter names
    ({"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}); {} on other ranks; None on
    every rank before the first optimizer step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not optimizer.state:
        # Before the first step there is nothing to save, and torch's state-dict API would first run a
        # zero-lr step to create the state: AdamW's step count would then be 1 before any real update.
        return None
    return get_optimizer_state_dict(unwrap(model), optimizer, options=_options(cpu_offload=True))


def _fqn_keyed(gpt: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Optimizer state saved before FQN keys (torch's own index keys) -> FQN keys. The index of a
    parameter is its position over the param groups, which build_optimizer makes deterministic."""
    keys = [*state["state"], *(p for g in state["param_groups"] for p in g["params"])]
    if all(isinstance(k, str) for k in keys):
        return state
    names = {id(p): n for n, p in gpt.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[int(i)]: v for i, v in state["state"].items()}, "param_groups": groups}


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict,
    optimizer_state: dict | None,
) -> None:
    """Collective: restore full, FQN-keyed state into this run's model and optimizer, whatever the mode
    and world size. Under torchrun only rank 0 needs the tensors (others pass {}), they are broadcast
    and re-sharded; `optimizer_state` must be None on every rank or on none."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    gpt = unwrap(model)
    opts = _options(broadcast_from_rank0=_broadcasting())
    set_model_state_dict(gpt, dict(model_state), options=opts)  # the API rewrites the dict it is given
    if optimizer_state is not None:
        state = _fqn_keyed(gpt, optimizer, optimizer_state) if optimizer_state else {}
        set_optimizer_state_dict(gpt, optimizer, state, options=opts)


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
