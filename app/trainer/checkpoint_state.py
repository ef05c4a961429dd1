"""What a checkpoint holds of a live run, and putting it back: the weights and optimizer state as
*pieces* (views of the boxes of each tensor a rank owns, keyed by parameter name), and the RNG states.

State is never gathered. Under FSDP a rank's piece of a tensor is its DTensor shard; under DDP (and in
one process) rank r takes an equal share of the rows of each replicated tensor, so ranks write in
parallel. A load fills every rank's own boxes in place from whatever world size and mode wrote the
checkpoint (checkpoint_format.ShardReader reads the overlapping slices), so checkpoints move between DDP
and FSDP and between world sizes, and no rank ever holds more than its own share plus one tensor.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from app.config import Config, config_from_dict
from app.errors import UserError
from app.trainer import checkpoint as ckpt
from app.trainer.distributed import DistEnv
from app.trainer.parallelize import unwrap
from app.trainer.schedule import DecayPlan, resume_change


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


def _local_box(t: DTensor) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """(local tensor, its offsets in the global tensor, whether this rank writes it). Replicated mesh
    dims (HSDP) are written by their coordinate-0 ranks only."""
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coords = t.device_mesh.get_coordinate() or []
    owner = all(c == 0 for c, pl in zip(coords, t.placements, strict=False) if isinstance(pl, Replicate))
    return t.to_local(), tuple(offsets), owner


def _piece(name: str, t: torch.Tensor, rank: int, world: int) -> Piece | None:
    """A DTensor gives its local shard; a plain tensor is the same on every rank and rank r writes rows
    [r*c, (r+1)*c) of it (c = ceil(rows / world)). 0-d tensors (Adam's step) are written by rank 0."""
    t = t.detach()
    if isinstance(t, DTensor):
        local, offsets, owner = _local_box(t)
        return Piece(name, local, tuple(t.shape), offsets) if owner and local.numel() else None
    if t.dim() == 0:
        return Piece(name, t, (), ()) if rank == 0 else None
    rows = t.shape[0]
    c = -(-rows // world)
    lo, hi = min(rank * c, rows), min((rank + 1) * c, rows)
    return Piece(name, t[lo:hi], tuple(t.shape), (lo,) + (0,) * (t.dim() - 1)) if lo < hi else None


def _tied_aliases(gpt: torch.nn.Module) -> dict[str, str]:
    """{alias: name} of parameters that are one tensor (tied embeddings): stored once, under `name`."""
    groups: dict[int, list[str]] = {}
    for name, p in gpt.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {alias: names[0] for names in groups.values() for alias in names[1:]}


def model_pieces(model: torch.nn.Module, rank: int, world: int) -> tuple[list[Piece], dict[str, str]]:
    """This rank's pieces of the weights (no communication, no copy) and the tied aliases."""
    gpt = unwrap(model)
    aliases = _tied_aliases(gpt)
    pieces = [_piece(n, t, rank, world) for n, t in gpt.state_dict().items() if n not in aliases]
    return [p for p in pieces if p is not None], aliases


def _named_params(gpt: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's parameters by name, in its order (over its param groups)."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    return {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}


def optimizer_pieces(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
) -> tuple[list[Piece], dict]:
    """This rank's pieces of the optimizer state, named "<param name>/<state name>", and the rest as
    JSON: {"param_groups": [{..., "params": [names]}], "scalars": {param name: {state name: value}}}.
    Generic over torch optimizers: every tensor in `optimizer.state` is stored, whatever its name."""
    params = _named_params(unwrap(model), optimizer)
    pieces, scalars = [], {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if not isinstance(value, torch.Tensor):
                scalars.setdefault(name, {})[key] = value
            elif (piece := _piece(f"{name}/{key}", value, rank, world)) is not None:
                pieces.append(piece)
    order, groups, i = list(params), [], 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": order[i : i + n]})
        i += n
    return pieces, {"param_groups": groups, "scalars": scalars}


def _target(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Where a load writes for `t` in place: the local shard and its offsets, or the whole tensor."""
    if isinstance(t, DTensor):
        local, offsets, _ = _local_box(t)
        return local, offsets
    return t, (0,) * t.dim()


@torch.no_grad()
def load_model(model: torch.nn.Module, reader) -> None:
    """Fill this rank's weights in place from a ShardReader: each rank reads only its own shard (FSDP) or
    the tensors it holds (DDP, one process), one at a time. No communication."""
    gpt = unwrap(model)
    aliases = _tied_aliases(gpt)
    for name, t in gpt.state_dict().items():
        if name not in aliases:
            local, offsets = _target(t)
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
        p, shape, dtype = params[pname], reader.shape(name), reader.dtype(name)
        if isinstance(p, DTensor) and shape == tuple(p.shape):
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
        state.setdefault(pname, {}).update(entry)
    return {"state": state, "param_groups": reader.param_groups}


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader) -> list[str]:
    """Restore the optimizer from a ShardReader. The state is fitted to this run's optimizer
    (app.trainer.optim.fit_state: the same mode is kept as is, AdamW <-> Muon converts, an unknown
    optimizer is refused in one line); the param groups become this run's. Returns lines to log."""
    from app.trainer.optim import fit_state

    gpt = unwrap(model)
    saved, notes = fit_state(read_optimizer_state(model, optimizer, reader), optimizer, gpt)
    index = {name: i for i, name in enumerate(_named_params(gpt, optimizer))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    state = {index[name]: entry for name, entry in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return notes


def rng_state() -> dict:
    """This process's RNG states as JSON (torch states as base64 bytes)."""
    py = random.getstate()
    npst = np.random.get_state(legacy=False)
    npst["state"] = {"key": npst["state"]["key"].tolist(), "pos": int(npst["state"]["pos"])}
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    out = {"python": [py[0], list(py[1]), py[2]], "numpy": npst, "torch": b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    npst = dict(state["numpy"])
    npst["state"] = {"key": np.asarray(npst["state"]["key"], dtype=np.uint32), "pos": npst["state"]["pos"]}
    np.random.set_state(npst)
    tensor = lambda b64: torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(tensor(state["torch"]))
    for i, s in enumerate(state.get("cuda", [])[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(tensor(s), i)


# ---------------------------------------------------------------- resume


def load_into(
    info: ckpt.CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[str]:
    """Restore weights (and optimizer state, when the checkpoint has it) in place, whatever world size and
    mode wrote them: every rank reads only the boxes it holds (its FSDP shards, or whole tensors under DDP
    and in one process), one tensor at a time. No communication, no full copy anywhere. Returns lines
    to log (an optimizer state converted between modes)."""
    with ckpt.open_reader(info) as reader:
        load_model(model, reader)
    if optimizer is not None and info.has_optimizer:
        with ckpt.open_reader(info, "optimizer") as reader:
            return load_optimizer(model, optimizer, reader)  # notes of a converted optimizer mode
    return []


def find_checkpoint(run_dir, spec: str, verify: str, env: DistEnv, warn) -> ckpt.CheckpointInfo | None:
    """`--resume auto`: the newest checkpoint of the run dir that verifies (rank 0 sets newer, unusable
    step dirs aside so they shadow nothing); `never`: None; else a run dir or step dir. Collective: the
    ranks share the sha256 checks, each hashing 1/world of the files, and agree on the answer."""
    if spec == "never":
        return None
    shared = ckpt.Shared(env.rank, env.world_size, env.all_true) if env.distributed else None
    if spec == "auto":
        info = ckpt.resolve_latest(run_dir, verify, warn, shared)
        if env.is_rank0:
            ckpt.set_aside_newer(run_dir, info.step if info else -1, warn=warn)
    else:
        info = ckpt.resolve(spec, verify, warn, shared)
    if info is not None and info.step == 0:  # older versions saved step 0: nothing learned, stale optimizer
        warn(f"ignoring {info.path}: a step-0 checkpoint holds nothing a fresh start does not")
        return None
    return info


def restore_weights(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    info: ckpt.CheckpointInfo,
    env: DistEnv,
    warn,
    log,
) -> None:
    """Every rank reads only the boxes it holds (its FSDP shards, or whole tensors under DDP), from
    whatever world size and mode wrote them: no broadcast, no full copy anywhere. An optimizer state of
    another mode (AdamW <-> Muon) is converted, with a line saying so."""
    ckpt.check_compatible(model, ckpt.load_model_shapes(info), info.path)  # every rank, index only
    for note in load_into(info, model, optimizer):
        (warn if note.startswith("warning:") else log)(note)
    if not info.has_optimizer:
        warn(f"warning: {info.path} has no optimizer state; the optimizer restarts from zero moments")
    saved_world = info.meta.get("world_size")
    if saved_world != env.world_size:
        log(
            f"resharding: checkpoint of world size {saved_world} on {env.world_size}: weights and "
            "optimizer restored exactly, data continues at the same global sample, RNG states start fresh"
        )
    rng = ckpt.load_rng_state(info, env.rank)
    if rng is not None and saved_world == env.world_size:
        set_rng_state(rng)


def schedule_note(info: ckpt.CheckpointInfo, cfg: Config, budget_decay: dict | None) -> str | None:
    """Say so when this run's LR at the resumed step differs from the checkpoint's schedule."""
    old = config_from_dict(info.meta.get("config") or cfg.to_dict())
    return resume_change(
        (old.schedule, old.optim, old.train.max_steps),
        (cfg.schedule, cfg.optim, cfg.train.max_steps),
        info.step,
        DecayPlan(**budget_decay) if budget_decay else None,
    )
