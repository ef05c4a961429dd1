"""One run per run directory, made ready at start (`prepare`). Retention, `latest`, export and the budget ledger all read a run dir as
one run's history; a fresh start (`--resume never`, or `--resume PATH` from elsewhere) in a directory
that already holds checkpoints would interleave two runs there and let retention delete the new
one's. So it is refused, or, with `--overwrite`, the old run is moved aside first, whole, into
RUN_DIR/previous-<UTC time>/ (nothing is deleted).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from app.errors import UserError
from app.trainer.checkpoint.store import CKPT_DIR, clean_temp_dirs, list_checkpoints
from app.trainer.parallel.distributed import DistEnv

# What belongs to one run (the budget too: a new run starts a new ledger).
RUN_FILES = (CKPT_DIR, "metrics.jsonl", "status.json", "budget", "stop.json", "stop.json.handled")


def prepare(run_dir: Path, resume: str, overwrite: bool, env: DistEnv) -> None:
    """Collective: the run dir ready for this start. A fresh start in a used one is refused or moves the
    old run aside (`--overwrite`); what a crash mid-save left behind is removed."""
    run_dir = Path(run_dir)
    if check_fresh_start(run_dir, resume, overwrite):
        if env.is_rank0:
            move_run_aside(run_dir, print)
        env.barrier()
    if env.is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        clean_temp_dirs(run_dir)
    env.barrier()


def check_fresh_start(run_dir: Path, resume: str, overwrite: bool) -> bool:
    """Every rank: True when the old run must be moved aside; UserError when a fresh start is refused."""
    run_dir = Path(run_dir)
    old = list_checkpoints(run_dir)
    if resume == "auto" or not old:
        return False
    newest = old[0].name
    if not overwrite:
        how = "--resume never" if resume == "never" else f"--resume {resume}"
        raise UserError(
            f"{run_dir} already holds a run (newest checkpoint {newest}); {how} there would mix two runs: "
            f"use a new --out, or add --overwrite to move the old run aside into {run_dir}/previous-<time>/"
        )
    if resume != "never" and Path(resume).resolve().is_relative_to(run_dir.resolve()):
        raise UserError(
            f"--resume {resume} lies inside --out {run_dir}, which --overwrite would move aside; "
            "to restart from an earlier step of this run, write to a new --out"
        )
    return True


def move_run_aside(run_dir: Path, log) -> Path:
    """Rank 0: move the old run's files into RUN_DIR/previous-<UTC time>/ and return that dir."""
    run_dir = Path(run_dir)
    dest = run_dir / time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime())
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir()
    moved = []
    for name in RUN_FILES:
        if (run_dir / name).exists():
            os.replace(run_dir / name, dest / name)
            moved.append(name)
    log(f"--overwrite: moved the previous run ({', '.join(moved)}) aside into {dest}")
    return dest
