"""The checkpoints' section (`checkpoint:`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """When checkpoints are written, how many are kept, how they are checked (app/trainer/checkpoint/)."""

    # run-dir lease (app/trainer/stopping/lease.py): a second trainer on the run dir waits this long, then exits 142
    lease_wait_seconds: float = 600.0
    lease_stale_seconds: float = 60.0  # a lease whose heartbeat stopped this long ago is taken over
    every_steps: int = 0  # save every N steps; 0 = off
    every_minutes: float = 60.0  # save every M minutes of training (agreed by the ranks); 0 = off
    keep_last: int = 3  # keep the newest N checkpoints (and the best)
    keep_best: bool = True  # keep the checkpoint with the lowest val loss too
    drop_optimizer_older: bool = False  # strip optimizer state from kept checkpoints but the latest
    verify: str = "sha256"  # how latest/best are verified at resume: sha256 | size
    async_save: bool = True  # stage to host memory, write in the background; stops still wait for it
