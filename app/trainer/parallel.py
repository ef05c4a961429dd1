"""Process groups, model wrapping (DDP or FSDP2), activation checkpointing, and the state-dict seam the
checkpoint code uses, so it never needs to know how the model is wrapped.

Modes (train.parallel; `auto` is resolved by app.memory.plan before the model is built):

    ddp   every rank holds the whole model, gradients are all-reduced (DistributedDataParallel);
          one process: the plain model
    fsdp  torch.distributed.fsdp.fully_shard on every transformer block, then on the root: parameters,
          gradients and AdamW state are sharded over the ranks (fp32 master shards); on CUDA the blocks
          compute in bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), on CPU in fp32

Checkpoint state is never gathered: every rank hands the checkpoint writer *pieces*, views of the boxes
of each tensor it owns, keyed by parameter name (FQN): its FSDP shard (a DTensor's local tensor and its
offsets), or under DDP an equal share of the rows of each replicated tensor. A load fills every rank's
own boxes in place from whatever world size and mode wrote the checkpoint (app/trainer/checkpoint_format.py
reads the overlapping slices). So checkpoints move between DDP and FSDP and between world sizes, and no
rank ever holds more than its own share plus one tensor.
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

    def all_true(self, flag: bool) -> bool:
        """Collective: whether `flag` holds on every rank (over the CPU control group: no GPU sync)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
        return bool(t.item())


_CONTROL_GROUP = None


def control_group():
    """The process group for the loop's small decisions (stop agreement, checkpoint votes): gloo over
    CPU tensors. Under NCCL a second group, so a decision never waits for the GPU's queue to drain; on
    CPU the default (gloo) group."""
    return _CONTROL_GROUP


def init_distributed(device_type: str, timeout_minutes: float = 30.0) -> DistEnv:
    """Read torchrun's environment; join the process group (gloo on CPU, NCCL on CUDA) and, under NCCL,
    a gloo control group. The timeout bounds every collective, so it must exceed the longest wait of
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
    from app.trainer.runtime import compile_blocks, compile_enabled

    if compile_enabled(cfg, device):
        compile_blocks(model, cfg.train.compile_mode)
        log(
            f"compile: {len(model.blocks)} blocks, mode {cfg.train.compile_mode} (compiled at the first step)"
        )
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


# ---------------------------------------------------------------- state for checkpoints (sharded, FQN-keyed)


@dataclass
class Piece:
    """This rank's part of one tensor for a checkpoint: `tensor` (a view of live state, not a copy) is the
    box of the global tensor of `shape` that starts at `offsets`."""

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.4
        return ()
    return DTensor


def _local_box(t) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """(local tensor, its offsets in the global tensor, whether this rank owns it for writing) of a
    DTensor. Replicated mesh dims (HSDP) are written by their coordinate-0 ranks only."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coords = t.device_mesh.get_coordinate() or []
    owner = all(c == 0 for c, pl in zip(coords, t.placements, strict=False) if isinstance(pl, Replicate))
    return t.to_local(), tuple(offsets), owner


def _piece(name: str, t: torch.Tensor, rank: int, world: int) -> Piece | None:
    """A DTensor gives its local shard; a plain tensor is the same on every rank (DDP, or one process)
    and rank r writes rows [r*c, (r+1)*c) of it (c = ceil(rows / world)), so ranks write in parallel
    and stage 1/world of it each. 0-d tensors (Adam's step) are written by rank 0."""
    t = t.detach()
    if isinstance(t, _dtensor_cls()):
        local, offsets, owner = _local_box(t)
        if not owner or local.numel() == 0:
            return None
        return Piece(name, local, tuple(t.shape), offsets)
    if t.dim() == 0:
        return Piece(name, t, (), ()) if rank == 0 else None
    rows = t.shape[0]
    c = -(-rows // world)
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    if lo >= hi:
        return None
    return Piece(name, t[lo:hi], tuple(t.shape), (lo,) + (0,) * (t.dim() - 1))


def _tied_names(gpt: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied embeddings), first name first."""
    groups: dict[int, list[str]] = {}
    for name, p in gpt.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def model_pieces(model: torch.nn.Module, rank: int, world: int) -> tuple[list[Piece], dict[str, str]]:
    """This rank's pieces of the weights (no communication, no copy) and the tied aliases {alias: name},
    whose tensors are stored once."""
    gpt = unwrap(model)
    aliases = {alias: names[0] for names in _tied_names(gpt) for alias in names[1:]}
    pieces = []
    for name, t in gpt.state_dict().items():
        if name not in aliases and (piece := _piece(name, t, rank, world)) is not None:
            pieces.append(piece)
    return pieces, aliases


def _param_names(gpt: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order (over its param groups)."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def optimizer_pieces(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
) -> tuple[list[Piece], dict]:
    """This rank's pieces of the optimizer state, named "<param name>/<state name>", and the rest as
    JSON: {"param_groups": [{..., "params": [names]}], "scalars": {param name: {state name: value}}}.
    Generic over torch optimizers: every tensor in `optimizer.state` is stored, whatever its name."""
    gpt = unwrap(model)
    order = _param_names(gpt, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pieces, scalars = [], {}
    for name, p in zip(order, params, strict=True):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                if (piece := _piece(f"{name}/{key}", value, rank, world)) is not None:
                    pieces.append(piece)
            else:
                scalars.setdefault(name, {})[key] = value
    groups, i = [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": order[i : i + n]})
        i += n
    return pieces, {"param_groups": groups, "scalars": scalars}


def _target(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Where a load writes for `t` in place: the local shard and its offsets, or the whole tensor."""
    if isinstance(t, _dtensor_cls()):
        local, offsets, _ = _local_box(t)
        return local, offsets
    return t, (0,) * t.dim()


@torch.no_grad()
def load_model(model: torch.nn.Module, reader) -> None:
    """Fill this rank's weights in place from a checkpoint reader (checkpoint_format.ShardReader): each
    rank reads only its own shard (FSDP) or the tensors it holds (DDP, one process), one at a time, from
    whatever world size wrote them. No communication."""
    gpt = unwrap(model)
    aliases = {alias for names in _tied_names(gpt) for alias in names[1:]}
    for name, t in gpt.state_dict().items():
        if name in aliases:
            continue
        local, offsets = _target(t)
        reader.read(reader.tied.get(name, name), local, offsets)


def read_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader) -> dict:
    """A checkpoint's optimizer state at this rank's shard sizes, keyed by parameter name:
    {"state": {name: {state name: value}}, "param_groups": [{..., "params": [names]}]} (the shape of
    torch.distributed.checkpoint's sharded optimizer state dict). Each tensor is read straight into a
    buffer of its local size (a DTensor like its parameter under FSDP). Old checkpoints keyed by torch's
    parameter index map through the optimizer's parameter order, which build_optimizer keeps stable."""
    from app.errors import UserError

    gpt = unwrap(model)
    order = _param_names(gpt, optimizer)
    params = dict(zip(order, (p for g in optimizer.param_groups for p in g["params"]), strict=True))

    def named(key: str) -> str:
        if key.isdigit() and key not in params:  # index-keyed (old) checkpoint
            return order[int(key)]
        if key not in params:
            raise UserError(
                f"the checkpoint's optimizer state has '{key}', which this model does not; resume with "
                "the config it was trained with, or start fresh with --resume never"
            )
        return key

    state: dict[str, dict] = {}
    for name in reader.names():
        pname, key = name.split("/", 1)
        pname = named(pname)
        p, shape, dtype = params[pname], reader.shape(name), reader.dtype(name)
        if isinstance(p, _dtensor_cls()) and shape == tuple(p.shape):
            from torch.distributed.tensor import DTensor

            local, offsets, _ = _local_box(p)
            buf = reader.read(name, torch.empty(local.shape, dtype=dtype, device=p.device), offsets)
            value = DTensor.from_local(
                buf, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        else:
            device = "cpu" if len(shape) == 0 else p.device  # Adam keeps `step` on the CPU
            value = reader.read(name, torch.empty(shape, dtype=dtype, device=device))
        state.setdefault(pname, {})[key] = value
    for pname, entry in reader.scalars.items():
        state.setdefault(named(str(pname)), {}).update(entry)
    groups = [{**g, "params": [named(str(k)) for k in g["params"]]} for g in reader.param_groups]
    return {"state": state, "param_groups": groups}


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader) -> list[str]:
    """Restore the optimizer from a checkpoint reader (read_optimizer_state). The state is fitted to this
    run's optimizer (app.trainer.optim.fit_state: the same mode is kept as is, AdamW <-> Muon converts, an
    unknown optimizer is refused in one line), the param groups become this run's. Returns lines to log."""
    from app.trainer.optim import fit_state

    gpt = unwrap(model)
    saved, notes = fit_state(read_optimizer_state(model, optimizer, reader), optimizer, gpt)
    index = {name: i for i, name in enumerate(_param_names(gpt, optimizer))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    state = {index[name]: entry for name, entry in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return notes


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= env.world_size
    return t


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
