"""What a checkpoint holds of a live run, and putting it back: the weights and optimizer state as
*pieces* (views of the boxes of each tensor a rank owns, keyed by parameter name), and the RNG states.

State is never gathered. Under FSDP a rank's piece of a tensor is its DTensor shard; under DDP (and in
one process) rank r takes an equal share of the rows of each replicated tensor, so ranks write in
parallel. A load fills every rank's own boxes in place from whatever world size and mode wrote the
checkpoint (format.ShardReader reads the overlapping slices), so checkpoints move between DDP
and FSDP and between world sizes, and no rank ever holds more than its own share plus one tensor.
"""

from __future__ import annotations

import base64
import random
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from app.errors import UserError
from app.trainer.checkpoint.store import CheckpointInfo, open_reader
from app.trainer.parallel.parallelize import unwrap


@dataclass
class TrainerState:
    """Everything besides weights and optimizer that exact resume needs (trainer_state.json)."""

    step: int = 0
    tokens: int = 0
    elapsed_seconds: float = 0.0  # training wall time over all restarts
    loader: dict = field(default_factory=dict)
    best_val_loss: float | None = None
    last_val_loss: float | None = None
    last_eval_step: int | None = None  # the step last_val_loss was measured at
    lr: float = 0.0  # of the last step: the LR that made these weights
    early_stopping: dict = field(default_factory=dict)
    spikes: dict = field(default_factory=dict)
    bad_steps: dict = field(default_factory=dict)
    budget_decay: dict | None = None  # the agreed end plan (DecayPlan: the budget's or max_hours'); old name
    spent_usd: float | None = None


@dataclass
class Piece:
    """This rank's part of one tensor: `tensor` (a view of live state, not a copy) is the box of the
    global tensor of `shape` that starts at `offsets`."""

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor. No DTensor exists before torch.distributed.tensor is imported, and
    importing it costs a second of every command's start (sample, export, plan, a refusal), so a process
    that never sharded anything is not made to import it here."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """(local tensor, its offsets in the global tensor, whether this rank writes it) of a DTensor.
    Replicated mesh dims (HSDP) are written by their coordinate-0 ranks only."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = tensor.device_mesh
    _, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    coordinates = mesh.get_coordinate() or []
    placed = zip(coordinates, tensor.placements, strict=False)
    owner = all(coordinate == 0 for coordinate, placement in placed if isinstance(placement, Replicate))
    return tensor.to_local(), tuple(offsets), owner


def _piece(name: str, tensor: torch.Tensor, rank: int, world: int) -> Piece | None:
    """A DTensor gives its local shard; a plain tensor is the same on every rank and rank r writes rows
    [r*share, (r+1)*share) of it (share = ceil(rows / world)). 0-d tensors (Adam's step) are written by
    rank 0."""
    tensor = tensor.detach()
    if _is_dtensor(tensor):
        local, offsets, owner = _local_box(tensor)
        if not owner or not local.numel():
            return None
        return Piece(name, local, tuple(tensor.shape), offsets)
    if tensor.dim() == 0:
        return Piece(name, tensor, (), ()) if rank == 0 else None
    rows = tensor.shape[0]
    share = -(-rows // world)
    first = min(rank * share, rows)
    end = min((rank + 1) * share, rows)
    if first >= end:
        return None
    offsets = (first,) + (0,) * (tensor.dim() - 1)
    return Piece(name, tensor[first:end], tuple(tensor.shape), offsets)


def _tied_aliases(gpt: torch.nn.Module) -> dict[str, str]:
    """{alias: name} of parameters that are one tensor (tied embeddings): stored once, under `name`."""
    groups: dict[int, list[str]] = {}
    for name, param in gpt.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {alias: names[0] for names in groups.values() for alias in names[1:]}


def model_pieces(model: torch.nn.Module, rank: int, world: int) -> tuple[list[Piece], dict[str, str]]:
    """This rank's pieces of the weights (no communication, no copy) and the tied aliases."""
    gpt = unwrap(model)
    aliases = _tied_aliases(gpt)
    pieces = [
        _piece(name, tensor, rank, world) for name, tensor in gpt.state_dict().items() if name not in aliases
    ]
    return [piece for piece in pieces if piece is not None], aliases


def _named_params(gpt: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's parameters by name, in its order (over its param groups)."""
    names = {id(param): name for name, param in gpt.named_parameters()}
    return {names[id(param)]: param for group in optimizer.param_groups for param in group["params"]}


def optimizer_pieces(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
) -> tuple[list[Piece], dict]:
    """This rank's pieces of the optimizer state, named "<param name>/<state name>", and the rest as
    JSON: {"param_groups": [{..., "params": [names]}], "scalars": {param name: {state name: value}}}.
    Generic over torch optimizers: every tensor in `optimizer.state` is stored, whatever its name."""
    params = _named_params(unwrap(model), optimizer)
    pieces = []
    scalars: dict[str, dict] = {}
    for name, param in params.items():
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                scalars.setdefault(name, {})[key] = value
                continue
            piece = _piece(f"{name}/{key}", value, rank, world)
            if piece is not None:
                pieces.append(piece)
    names = iter(params)  # in the optimizer's order: each group takes the next len(params) names
    groups = []
    for group in optimizer.param_groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        groups.append({**settings, "params": [next(names) for _ in group["params"]]})
    return pieces, {"param_groups": groups, "scalars": scalars}


def _target(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Where a load writes for `tensor` in place: the local shard and its offsets, or the whole tensor."""
    if _is_dtensor(tensor):
        local, offsets, _ = _local_box(tensor)
        return local, offsets
    return tensor, (0,) * tensor.dim()


@torch.no_grad()
def load_model(model: torch.nn.Module, reader) -> None:
    """Fill this rank's weights in place from a ShardReader: each rank reads only its own shard (FSDP) or
    the tensors it holds (DDP, one process), one at a time. No communication."""
    gpt = unwrap(model)
    aliases = _tied_aliases(gpt)
    for name, tensor in gpt.state_dict().items():
        if name not in aliases:
            local, offsets = _target(tensor)
            reader.read(reader.tied.get(name, name), local, offsets)


def read_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader) -> dict:
    """A checkpoint's optimizer state at this rank's shard sizes, keyed by parameter name:
    {"state": {name: {state name: value}}, "param_groups": [{..., "params": [names]}]}. Each tensor is
    read straight into a buffer of its local size (a DTensor like its parameter under FSDP)."""
    params = _named_params(unwrap(model), optimizer)
    state: dict[str, dict] = {}
    for name in reader.names():
        pname, key = name.split("/", 1)
        if pname not in params:
            raise UserError(
                f"the checkpoint's optimizer state has '{pname}', which this model does not; resume with "
                "the config it was trained with, or start fresh with --resume never"
            )
        param = params[pname]
        shape = reader.shape(name)
        dtype = reader.dtype(name)
        if _is_dtensor(param) and shape == tuple(param.shape):
            from torch.distributed.tensor import DTensor

            local, offsets, _ = _local_box(param)
            buffer = torch.empty(local.shape, dtype=dtype, device=param.device)
            reader.read(name, buffer, offsets)
            value = DTensor.from_local(
                buffer,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        else:
            device = "cpu" if len(shape) == 0 else param.device  # Adam keeps `step` on the CPU
            value = reader.read(name, torch.empty(shape, dtype=dtype, device=device))
        state.setdefault(pname, {})[key] = value
    for pname, entry in reader.scalars.items():
        state.setdefault(pname, {}).update(entry)
    return {"state": state, "param_groups": reader.param_groups}


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader) -> list[str]:
    """Restore the optimizer from a ShardReader. The state is fitted to this run's optimizer
    (app.trainer.optimization.optimizer.fit_state: the same mode is kept as is, AdamW <-> Muon converts, an unknown
    optimizer is refused in one line); the param groups become this run's. Returns lines to log."""
    from app.trainer.optimization.optimizer import fit_state

    gpt = unwrap(model)
    saved, notes = fit_state(read_optimizer_state(model, optimizer, reader), optimizer, gpt)
    index = {name: i for i, name in enumerate(_named_params(gpt, optimizer))}
    groups = [
        {**group, "params": [index[name] for name in group["params"]]} for group in saved["param_groups"]
    ]
    state = {index[name]: entry for name, entry in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return notes


def _to_base64(rng: torch.Tensor) -> str:
    return base64.b64encode(rng.numpy().tobytes()).decode()


def _from_base64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """This process's RNG states as JSON (torch states as base64 bytes)."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    bit_generator = numpy_state["state"]
    numpy_state["state"] = {"key": bit_generator["key"].tolist(), "pos": int(bit_generator["pos"])}
    out = {
        "python": [version, list(internal), gauss],
        "numpy": numpy_state,
        "torch": _to_base64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_to_base64(cuda_state) for cuda_state in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = dict(state["numpy"])
    bit_generator = numpy_state["state"]
    numpy_state["state"] = {
        "key": np.asarray(bit_generator["key"], dtype=np.uint32),
        "pos": bit_generator["pos"],
    }
    np.random.set_state(numpy_state)
    torch.set_rng_state(_from_base64(state["torch"]))
    for device, cuda_state in enumerate(state.get("cuda", [])[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(_from_base64(cuda_state), device)


# ---------------------------------------------------------------- resume


def load_into(
    info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[str]:
    """Restore weights (and optimizer state, when the checkpoint has it) in place, whatever world size and
    mode wrote them: every rank reads only the boxes it holds (its FSDP shards, or whole tensors under DDP
    and in one process), one tensor at a time. No communication, no full copy anywhere. Returns lines
    to log (an optimizer state converted between modes)."""
    with open_reader(info) as reader:
        load_model(model, reader)
    if optimizer is not None and info.has_optimizer:
        with open_reader(info, "optimizer") as reader:
            return load_optimizer(model, optimizer, reader)  # notes of a converted optimizer mode
    return []
