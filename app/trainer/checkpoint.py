"""Checkpoints: one directory per step, written atomically, verified on resume, no pickle.

    checkpoints/step_000123/
      model.safetensors       weights (tied weights stored once, aliases in meta.json)
      optimizer.safetensors   optimizer tensors, keyed "<i>.<state name>" (i: position in param_keys)
      optimizer.json          param_keys (parameter names), param groups, non-tensor optimizer state
      trainer_state.json      step, tokens, loader position, schedule, early stopping, best val loss
      rng_rank<R>.json        python / numpy / torch RNG states of rank R
      meta.json               config, versions, step, val loss, sha256 + size of every file above

A save goes to `checkpoints/.tmp-step_000123-<pid>/`, every file and the dir are fsync'd, meta.json is
written last, then the dir is renamed into place. A crash at any moment leaves either the old set
of checkpoints or the new one complete; leftover temp dirs are removed at the next start.
`latest` and `best` are found by scanning and verifying, never from a pointer file.
"""

from __future__ import annotations

import base64
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from app.errors import UserError
from app.files import fsync_dir, fsync_file, sha256_file
from app.files import write_json_durable as write_json

CKPT_DIR = "checkpoints"
PREFIX = "step_"
STEP_DIR = re.compile(r"^step_\d{6,}$")
META = "meta.json"
FORMAT_VERSION = 1
OPTIMIZER_FILES = ("optimizer.safetensors", "optimizer.json")


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CKPT_DIR


# ---------------------------------------------------------------- state <-> tensors + JSON


def split_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory: keep the first name, record the others."""
    seen: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach().contiguous().cpu()
    return tensors, aliases


def optimizer_to_files(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state dict -> (tensors for safetensors, JSON-able structure).

    Parameters are keyed by name (FQNs such as "blocks.0.attn.wq.weight", what app.parallel produces in
    DDP and FSDP alike) or by torch's own index. Tensors are stored as "<i>.<state name>" where i is the
    position in structure["param_keys"], which keeps the original keys, dots and all."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    keys: list = []
    for i, (pkey, entry) in enumerate(state["state"].items()):
        keys.append(pkey)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{i}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(i), {})[key] = value
    return tensors, {"param_keys": keys, "param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict[str, torch.Tensor], structure: dict) -> dict:
    """Inverse of optimizer_to_files; files written before `param_keys` existed have index keys."""
    keys = structure.get("param_keys")

    def pkey(i: str):
        return keys[int(i)] if keys is not None else int(i)

    state: dict[Any, dict[str, Any]] = {k: {} for k in keys or []}
    for name, t in tensors.items():
        i, key = name.split(".", 1)
        state.setdefault(pkey(i), {})[key] = t
    for i, entry in structure.get("scalars", {}).items():
        state.setdefault(pkey(i), {}).update(entry)
    return {"state": state, "param_groups": structure["param_groups"]}


def rng_state() -> dict:
    """This process's RNG states as JSON (torch states as base64 bytes)."""
    py = random.getstate()
    npst = np.random.get_state(legacy=False)
    npst["state"] = {"key": npst["state"]["key"].tolist(), "pos": int(npst["state"]["pos"])}
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": npst,
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    npst = dict(state["numpy"])
    npst["state"] = {"key": np.asarray(npst["state"]["key"], dtype=np.uint32), "pos": npst["state"]["pos"]}
    np.random.set_state(npst)

    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(tensor(s), i)


def versions() -> dict:
    from app import __version__

    return {
        "pretrain": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "numpy": np.__version__,
    }


# ---------------------------------------------------------------- save


@dataclass
class SaveResult:
    path: Path
    seconds: float
    bytes: int


class CheckpointWriter:
    """Distributed save: rank 0 owns the temp dir and the rename; every rank writes its RNG file.

    The run dir must be on storage all ranks see (the checkpoint PVC is ReadWriteMany).
    """

    def __init__(self, run_dir: Path, rank: int, world_size: int, barrier) -> None:
        self.root = checkpoints_root(run_dir)
        self.rank, self.world, self.barrier = rank, world_size, barrier

    def tmp_dir(self, step: int) -> Path:
        return self.root / f".tmp-{step_dir_name(step)}"

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict | None,
        trainer_state: dict,
        meta: dict,
        extra_files: list[Path] = (),
    ) -> SaveResult:
        """Collective: every rank calls it. `extra_files` (e.g. the tokenizer) are copied in, so a
        checkpoint dir alone is enough to sample from or export."""
        start = time.monotonic()
        tmp = self.tmp_dir(step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        self.barrier()
        write_json(tmp / f"rng_rank{self.rank}.json", rng_state())
        self.barrier()
        final = self.root / step_dir_name(step)
        nbytes = 0
        if self.rank == 0:
            tensors, aliases = split_tied(model_state)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            if optimizer_state is not None:
                opt_tensors, structure = optimizer_to_files(optimizer_state)
                save_file(opt_tensors, str(tmp / "optimizer.safetensors"), metadata={"format": "pt"})
                write_json(tmp / "optimizer.json", structure)
            write_json(tmp / "trainer_state.json", trainer_state)
            for extra in extra_files:
                shutil.copyfile(extra, tmp / Path(extra).name)
            files = {}
            for p in sorted(tmp.iterdir()):
                fsync_file(p)
                files[p.name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                nbytes += p.stat().st_size
            meta = {
                **meta,
                "format_version": FORMAT_VERSION,
                "step": step,
                "tied": aliases,
                "world_size": self.world,
                "versions": versions(),
                "saved_unix": time.time(),
                "files": files,
            }
            write_json(tmp / META, meta)
            fsync_dir(tmp)
            if final.exists():  # re-saving a step (e.g. a stop right after a resume): swap atomically
                old = self.root / f".old-{final.name}-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(self.root)
        self.barrier()
        return SaveResult(final, time.monotonic() - start, nbytes)


def clean_temp_dirs(run_dir: Path) -> None:
    """Remove what a crash mid-save left behind (rank 0, at start)."""
    root = checkpoints_root(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------- resolve and verify


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    meta: dict

    @property
    def val_loss(self) -> float | None:
        return self.meta.get("val_loss")

    @property
    def has_optimizer(self) -> bool:
        return all(f in self.meta.get("files", {}) for f in OPTIMIZER_FILES)


def read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) and "files" in meta and "step" in meta else None


def verify(info_path: Path, mode: str = "sha256") -> tuple[CheckpointInfo | None, str]:
    """(checkpoint, "") when complete and intact, else (None, why not)."""
    meta = read_meta(info_path)
    if meta is None:
        return None, "meta.json missing or unreadable"
    for name, entry in meta["files"].items():
        p = info_path / name
        try:
            size = p.stat().st_size
        except OSError:
            return None, f"{name} is missing"
        if size != entry["bytes"]:
            return None, f"{name} has {size} bytes, expected {entry['bytes']}"
        if mode == "sha256" and sha256_file(p) != entry["sha256"]:
            return None, f"{name} fails its sha256 check"
    return CheckpointInfo(info_path, int(meta["step"]), meta), ""


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Candidate step dirs, newest first (names are zero-padded so this sorts by step)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), reverse=True)


def warn_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def finite_val_loss(meta: dict | None) -> float | None:
    """The checkpoint's val loss when it is a real number (a diverged eval's NaN never ranks as best)."""
    val = (meta or {}).get("val_loss")
    return float(val) if isinstance(val, (int, float)) and math.isfinite(val) else None


def resolve_latest(run_dir: Path, mode: str = "sha256", warn=warn_stderr) -> CheckpointInfo | None:
    """Newest checkpoint that verifies; corrupt or partial ones are skipped with a warning."""
    for path in list_checkpoints(run_dir):
        info, why = verify(path, mode)
        if info:
            return info
        warn(f"warning: skipping checkpoint {path}: {why}")
    return None


def resolve_best(run_dir: Path, mode: str = "sha256", warn=warn_stderr) -> CheckpointInfo | None:
    """Lowest (finite) val loss among checkpoints that verify."""
    candidates = []
    for path in list_checkpoints(run_dir):
        meta = read_meta(path)
        if (val := finite_val_loss(meta)) is not None:
            candidates.append((val, -int(meta["step"]), path))
    for _, _, path in sorted(candidates):
        info, why = verify(path, mode)
        if info:
            return info
        warn(f"warning: skipping checkpoint {path}: {why}")
    return None


def resolve(spec: str | Path, mode: str = "sha256", warn=warn_stderr) -> CheckpointInfo:
    """A run dir (its latest checkpoint) or a step dir -> a verified checkpoint, else UserError."""
    path = Path(spec)
    if (path / META).exists():
        info, why = verify(path, mode)
        if info is None:
            raise UserError(f"checkpoint {path} is not usable: {why}")
        return info
    if not path.exists():
        raise UserError(f"{path} does not exist; pass a run dir or a checkpoints/step_NNNNNN dir")
    info = resolve_latest(path, mode, warn)
    if info is None:
        raise UserError(f"no usable checkpoint under {path}; train first with `pretrain train --out {path}`")
    return info


# ---------------------------------------------------------------- load


def load_model_state(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    state = load_file(str(info.path / "model.safetensors"))
    for alias, target in info.meta.get("tied", {}).items():
        state[alias] = state[target]
    return state


def load_model_shapes(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The checkpoint's weight names and shapes as meta tensors, from the safetensors header only: lets
    every rank run check_compatible while only rank 0 loads the weights."""
    from safetensors import safe_open

    shapes = {}
    with safe_open(str(info.path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            shapes[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
    for alias, target in info.meta.get("tied", {}).items():
        shapes[alias] = shapes[target]
    return shapes


def load_optimizer_state(info: CheckpointInfo) -> dict | None:
    if not info.has_optimizer:
        return None
    tensors = load_file(str(info.path / "optimizer.safetensors"))
    structure = json.loads((info.path / "optimizer.json").read_text())
    return optimizer_from_files(tensors, structure)


def load_trainer_state(info: CheckpointInfo) -> dict:
    return json.loads((info.path / "trainer_state.json").read_text())


def load_rng_state(info: CheckpointInfo, rank: int) -> dict | None:
    p = info.path / f"rng_rank{rank}.json"
    return json.loads(p.read_text()) if p.exists() else None


def check_compatible(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """One clear line when a checkpoint does not fit the configured model."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise UserError(
            f"checkpoint {path} does not fit the configured model ({what}); "
            "use the config it was trained with, or a new --out (or --resume never --overwrite to move that run aside)"
        )
    for name, t in own.items():
        if tuple(state[name].shape) != tuple(t.shape):
            hint = " (vocab size differs)" if name == "tok_emb.weight" else ""
            raise UserError(
                f"checkpoint {path} does not fit the configured model: {name} is "
                f"{tuple(state[name].shape)} there, {tuple(t.shape)} here{hint}; "
                "use the config it was trained with, or a new --out (or --resume never --overwrite to move that run aside)"
            )


# ---------------------------------------------------------------- retention


def apply_retention(run_dir: Path, keep_last: int, keep_best: bool, drop_optimizer_older: bool) -> list[Path]:
    """Keep the newest `keep_last` complete checkpoints and the best; returns the removed dirs. Checks
    sizes only (no hashing); a checkpoint that fails even that is left alone and takes no slot."""
    paths = list_checkpoints(run_dir)
    metas = {p: read_meta(p) for p in paths}
    complete = [p for p in paths if metas[p] is not None and verify(p, "size")[0] is not None]
    keep = set(complete[:keep_last])
    if keep_best:
        scored = [(v, p) for p in complete if (v := finite_val_loss(metas[p])) is not None]
        if scored:
            keep.add(min(scored)[1])
    removed = []
    for p in complete:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if drop_optimizer_older and complete:
        for p in sorted(keep, reverse=True)[1:]:
            _drop_optimizer(p, metas[p])
    return removed


def _drop_optimizer(path: Path, meta: dict) -> None:
    """Rewrite meta.json first (atomically), then delete: a crash between leaves a valid checkpoint."""
    if not any(f in meta["files"] for f in OPTIMIZER_FILES):
        return
    meta = {**meta, "files": {k: v for k, v in meta["files"].items() if k not in OPTIMIZER_FILES}}
    tmp = path / f".{META}.tmp"
    write_json(tmp, meta)
    os.replace(tmp, path / META)
    for f in OPTIMIZER_FILES:
        (path / f).unlink(missing_ok=True)


def set_aside_newer(run_dir: Path, step: int, warn=warn_stderr) -> list[Path]:
    """Rank 0, after resuming from `step`: step dirs newer than it failed verification and belong to an
    abandoned future. Renamed to checkpoints/corrupt-step_NNNNNN (kept for inspection, no longer listed),
    so they neither shadow the run's new checkpoints nor take a retention slot."""
    moved = []
    for path in list_checkpoints(run_dir):
        if int(path.name[len(PREFIX) :]) > step:
            dest = path.with_name(f"corrupt-{path.name}")
            if dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            os.replace(path, dest)
            warn(f"warning: moved unusable checkpoint {path} aside to {dest}")
            moved.append(dest)
    return moved


def summary(run_dir: Path, mode: str, warn=warn_stderr) -> list[str]:
    """The lines a finished run prints: its latest and best checkpoints."""
    return [
        f"latest checkpoint: {describe(resolve_latest(run_dir, mode, warn))}",
        f"best checkpoint:   {describe(resolve_best(run_dir, mode, warn))}",
    ]


def describe(info: CheckpointInfo | None) -> str:
    if info is None:
        return "none"
    loss = f", val loss {info.val_loss:.4f}" if info.val_loss is not None else ""
    return f"{info.path} (step {info.step}{loss})"
