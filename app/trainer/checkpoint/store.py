"""Checkpoints on disk: one directory per step, written by every rank in parallel, committed atomically
(writer.py), verified on resume, no pickle. `latest` and `best` are found by scanning and verifying,
never from a pointer file, so a crash at any moment leaves a valid set. Reading a checkpoint's meta,
index and trainer state; retention. The directory's files: docs/architecture.md ("The run directory").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from app.errors import UserError
from app.errors import print_stderr as warn_stderr
from app.files import sha256_file
from app.trainer.checkpoint.format import MODEL_INDEX, OPTIMIZER_INDEX, ShardReader, write_json_file

CKPT_DIR = "checkpoints"
PREFIX = "step_"
STEP_DIR = re.compile(r"^step_\d{6,}$")
META = "meta.json"
FORMAT_VERSION = 2
REFIT = (
    "use the config it was trained with, or a new --out "
    "(or --resume never --overwrite to move that run aside)"
)


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def step_of(step_dir: Path) -> int:
    return int(step_dir.name[len(PREFIX) :])


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CKPT_DIR


def versions() -> dict:
    from app import __version__

    return {
        "pretrain": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "numpy": np.__version__,
    }


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
        return OPTIMIZER_INDEX in self.meta.get("files", {})


def read_meta(path: Path) -> dict | None:
    """meta.json as a dict, or None when it is missing or unreadable: torn, not JSON, or not even UTF-8
    (bit rot, a torn write on some filesystems) are all the same damaged checkpoint."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return meta if isinstance(meta, dict) and "files" in meta and "step" in meta else None


def check_format(path: Path, meta: dict) -> str:
    """ "" for a checkpoint of FORMAT_VERSION. Any other format number is refused in one line, never
    skipped (a fresh start would bury that run): an older one (format 1 had no field), or a newer one (a
    downgrade: written by a newer pretrain, or a build of this release number that changed the format),
    naming both formats and releases. Only a field that is not a format number at all (not an int, or
    not positive) is damage: returned as the reason, so the checkpoint is skipped like any corrupt one
    and the previous one is used."""
    from app import __version__

    found = meta.get("format_version", 1)
    if found == FORMAT_VERSION:
        return ""
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        return f"meta.json has a damaged format_version ({found!r})"
    wrote = (meta.get("versions") or {}).get("pretrain")
    if found < FORMAT_VERSION:
        raise UserError(
            f"{path} is in checkpoint format {found} (written by pretrain {wrote or 'an older version'}), "
            f"which this version does not read (format {FORMAT_VERSION}): use the pretrain version that "
            "wrote it, or train into a new --out"
        )
    raise UserError(
        f"{path} is in checkpoint format {found}, written by pretrain {wrote or 'a newer version'}; this is "
        f"pretrain {__version__}, which reads format {FORMAT_VERSION}: resume it with the pretrain that "
        "wrote it (or a newer one), or train into a new --out"
    )


@dataclass(frozen=True)
class Shared:
    """Verification shared by the ranks of a job: rank r hashes every world-th file (all ranks check
    every size), and `agree` (an all-reduce) tells every rank whether every part passed, so all ranks
    pick the same checkpoint having read it once between them, not once each."""

    rank: int
    world: int
    agree: Callable[[bool], bool]


def verify(
    info_path: Path,
    mode: str = "sha256",
    shared: Shared | None = None,
    hash_only: Callable[[str], bool] | None = None,
) -> tuple[CheckpointInfo | None, str]:
    """(checkpoint, "") when complete and intact, else (None, why not). With `shared`, only this rank's
    part of the sha256 checks (not agreed yet: see resolve_latest). `hash_only`: the files whose sha256
    is checked (every file's size is), e.g. `for_inference`: a reader of the weights hashes only them."""
    meta = read_meta(info_path)
    if meta is None:
        return None, "meta.json missing or unreadable"
    if damaged := check_format(info_path, meta):
        return None, damaged
    for i, (name, entry) in enumerate(sorted(meta["files"].items())):
        mine = (shared is None or i % shared.world == shared.rank) and (hash_only is None or hash_only(name))
        p = info_path / name
        try:
            size = p.stat().st_size
        except OSError:
            return None, f"{name} is missing"
        if size != entry["bytes"]:
            return None, f"{name} has {size} bytes, expected {entry['bytes']}"
        if mode == "sha256" and mine and sha256_file(p) != entry["sha256"]:
            return None, f"{name} fails its sha256 check"
    return CheckpointInfo(info_path, int(meta["step"]), meta), ""


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Candidate step dirs, newest first (names are zero-padded so this sorts by step)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), reverse=True)


def finite_val_loss(meta: dict | None) -> float | None:
    """The checkpoint's val loss when it is a real number (a diverged eval's NaN never ranks as best)."""
    val = (meta or {}).get("val_loss")
    return float(val) if isinstance(val, (int, float)) and math.isfinite(val) else None


def configured_verify(spec: str | Path) -> str:
    """The verify mode (`checkpoint.verify`) the run was configured with, from a step dir's meta.json or
    the newest readable one of a run dir; sha256 (the default) when none says."""
    path = Path(spec)
    for cand in [path] if (path / META).exists() else list_checkpoints(path):
        meta = read_meta(cand)
        if meta is not None:
            mode = ((meta.get("config") or {}).get("checkpoint") or {}).get("verify")
            return mode if mode in ("sha256", "size") else "sha256"
    return "sha256"


def for_inference(name: str) -> bool:
    """The files a reader of the weights uses (all but the optimizer state): what `hash_only` hashes for
    sample, eval and serve."""
    return not (name == OPTIMIZER_INDEX or name.startswith("optimizer-rank"))


def _verified(
    path: Path, mode: str, shared: Shared | None, hash_only: Callable[[str], bool] | None = None
) -> tuple[CheckpointInfo | None, str]:
    info, why = verify(path, mode, shared, hash_only)
    if shared is not None and not shared.agree(info is not None):  # collective
        return None, why or "a file checked by another rank is damaged"
    return info, why


def resolve_latest(
    run_dir: Path,
    mode: str = "sha256",
    warn=warn_stderr,
    shared: Shared | None = None,
    hash_only: Callable[[str], bool] | None = None,
    skipped: list[tuple[Path, str]] | None = None,
) -> CheckpointInfo | None:
    """Newest checkpoint that verifies; corrupt or partial ones are skipped with a warning (and listed in
    `skipped` with the reason, newest first). With `shared`, collective: every rank gets the same answer."""
    for path in list_checkpoints(run_dir):
        info, why = _verified(path, mode, shared, hash_only)
        if info:
            return info
        if skipped is not None:
            skipped.append((path, why))
        warn(f"warning: skipping checkpoint {path}: {why}")
    return None


def all_unusable(run_dir: Path, skipped: list[tuple[Path, str]]) -> UserError:
    """The refusal of a start whose every checkpoint (`skipped`, newest first, with why) is unusable: a
    fresh start would bury that run's history under a second one in the same run dir. Starting over is
    the user's choice, made with --resume never --overwrite (which moves the old run aside, whole)."""
    shown = ", ".join(f"{path.name} ({why})" for path, why in skipped[:3])
    more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    return UserError(
        f"every checkpoint in {checkpoints_root(run_dir)} is unusable: {shown}{more}; a fresh start would bury "
        "that run: restore them from a copy, or start over on purpose with --resume never --overwrite "
        f"(moves the old run, these checkpoints included, into {run_dir}/previous-<time>/)"
    )


def resolve_best(
    run_dir: Path,
    mode: str = "sha256",
    warn=warn_stderr,
    hash_only: Callable[[str], bool] | None = None,
    known: CheckpointInfo | None = None,
) -> CheckpointInfo | None:
    """Lowest (finite) val loss among checkpoints that verify (in `mode`: a checkpoint whose val loss is
    lower but whose files fail it is skipped with a warning, never returned). `known`: a checkpoint the
    caller has already verified in this mode (not hashed again)."""
    candidates = []
    for path in list_checkpoints(run_dir):
        meta = read_meta(path)
        if (val := finite_val_loss(meta)) is not None:
            candidates.append((val, -int(meta["step"]), path))
    for _, _, path in sorted(candidates):
        if known is not None and path == known.path:
            return known
        info, why = verify(path, mode, hash_only=hash_only)
        if info:
            return info
        warn(f"warning: skipping checkpoint {path}: {why}")
    return None


def resolve(
    spec: str | Path,
    mode: str = "sha256",
    warn=warn_stderr,
    shared: Shared | None = None,
    hash_only: Callable[[str], bool] | None = None,
) -> CheckpointInfo:
    """A run dir (its latest checkpoint) or a step dir -> a verified checkpoint, else UserError."""
    path = Path(spec)
    if (path / META).exists():
        info, why = _verified(path, mode, shared, hash_only)
        if info is None:
            raise UserError(f"checkpoint {path} is not usable: {why}")
        return info
    if not path.exists():
        raise UserError(f"{path} does not exist; pass a run dir or a checkpoints/step_NNNNNN dir")
    info = resolve_latest(path, mode, warn, shared, hash_only)
    if info is None:
        raise UserError(f"no usable checkpoint under {path}; train first with `pretrain train --out {path}`")
    return info


# ---------------------------------------------------------------- load


def open_reader(info: CheckpointInfo, kind: str = "model") -> ShardReader:
    """kind: model | optimizer. Use as a context manager; reads boxes of tensors in any format."""
    if kind == "optimizer" and not info.has_optimizer:
        raise ValueError(f"{info.path} has no optimizer state")
    index = MODEL_INDEX if kind == "model" else OPTIMIZER_INDEX
    return ShardReader(info.path, json.loads((info.path / index).read_text()))


def load_model_shapes(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The checkpoint's weight names and shapes as meta tensors, from the index only: lets every rank run
    check_compatible before reading anything."""
    return _by_name(info, lambda r, name: torch.empty(r.shape(name), device="meta"))


def load_model_state(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The full weights by name (tied names share one tensor): the whole model in memory, one process."""
    return _by_name(info, lambda r, name: r.full(name))


def _by_name(info: CheckpointInfo, get: Callable[[ShardReader, str], torch.Tensor]) -> dict:
    with open_reader(info) as r:
        tensors = {name: get(r, name) for name in r.names()}
        return tensors | {alias: tensors[target] for alias, target in r.tied.items()}


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
        raise UserError(f"checkpoint {path} does not fit the configured model ({what}); {REFIT}")
    for name, t in own.items():
        if tuple(state[name].shape) != tuple(t.shape):
            hint = " (vocab size differs)" if name == "tok_emb.weight" else ""
            if name == "tok_emb.weight" and state[name].shape[0] == model.cfg.vocab_size != t.shape[0]:
                hint = " (written before vocabulary padding: resume it with --set model.vocab_multiple=1)"
            what = f"{name} is {tuple(state[name].shape)} there, {tuple(t.shape)} here{hint}"
            raise UserError(f"checkpoint {path} does not fit the configured model: {what}; {REFIT}")


# ---------------------------------------------------------------- retention


def apply_retention(run_dir: Path, keep_last: int, keep_best: bool, drop_optimizer_older: bool) -> list[Path]:
    """Keep the newest `keep_last` complete checkpoints and the best; returns the removed dirs. Checks
    sizes only (no hashing); a checkpoint that fails even that is left alone and takes no slot."""
    complete = [info for p in list_checkpoints(run_dir) if (info := verify(p, "size")[0]) is not None]
    keep = {info.path for info in complete[:keep_last]}
    scored = [(v, info.path) for info in complete if (v := finite_val_loss(info.meta)) is not None]
    if keep_best and scored:
        keep.add(min(scored)[1])
    removed = [info.path for info in complete if info.path not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if drop_optimizer_older:
        for info in [info for info in complete if info.path in keep][1:]:  # all but the newest
            _drop_optimizer(info.path, info.meta)
    return removed


def _drop_optimizer(path: Path, meta: dict) -> None:
    """Rewrite meta.json first (atomically), then delete: a crash between leaves a valid checkpoint."""
    drop = [f for f in meta.get("files", {}) if not for_inference(f)]
    if not drop:
        return
    meta = {**meta, "files": {k: v for k, v in meta["files"].items() if k not in drop}}
    tmp = path / f".{META}.tmp"
    write_json_file(tmp, meta)
    os.replace(tmp, path / META)
    for f in drop:
        (path / f).unlink(missing_ok=True)


def set_aside_newer(run_dir: Path, step: int, warn=warn_stderr) -> list[Path]:
    """Rank 0, after resuming from `step`: step dirs newer than it failed verification and belong to an
    abandoned future. Renamed to checkpoints/corrupt-step_NNNNNN (kept for inspection, no longer listed),
    so they neither shadow the run's new checkpoints nor take a retention slot."""
    moved = []
    for path in list_checkpoints(run_dir):
        if step_of(path) > step:
            dest = path.with_name(f"corrupt-{path.name}")
            if dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            os.replace(path, dest)
            warn(f"warning: moved unusable checkpoint {path} aside to {dest}")
            moved.append(dest)
    return moved


def summary(run_dir: Path, mode: str, warn=warn_stderr) -> list[str]:
    """The lines a finished run prints: its latest and best checkpoints. The best is the lowest val loss
    among checkpoints evaluated at their own step; when none was (a stop between an evaluation and the
    next save), the last evaluation before the latest checkpoint is named with it."""
    latest = resolve_latest(run_dir, mode, warn)
    best = resolve_best(run_dir, mode, warn, known=latest)
    line = describe(best)
    state = {}
    if latest is not None and best is None:
        with contextlib.suppress(OSError, ValueError):  # verified by size only, it may still be damaged
            state = load_trainer_state(latest)
    val, step = state.get("last_val_loss"), state.get("last_eval_step")
    if isinstance(val, (int, float)) and isinstance(step, int):
        line += (
            f" evaluated at its own step; the last evaluation, at step {step}, gave val loss {val:.4f} "
            "(the checkpoints follow it; docs/training.md: Checkpoints)"
        )
    return [f"latest checkpoint: {describe(latest)}", f"best checkpoint:   {line}"]


def describe(info: CheckpointInfo | None) -> str:
    if info is None:
        return "none"
    loss = f", val loss {info.val_loss:.4f}" if info.val_loss is not None else ""
    return f"{info.path} (step {info.step}{loss})"
