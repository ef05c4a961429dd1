"""RUN_DIR/status.json: the trainer's heartbeat, read by the budget watcher (sidecar or thread) for its
projection (step and checkpoint times) and to know when the run is done. Global rank 0 writes it, through
the loop's door to the budget (app/trainer/stopping/budget_link.py's BudgetLink.beat)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from app.files import atomic_write_json

EVERY_SECONDS = 5.0


class Heartbeat:
    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = Path(run_dir) / "status.json"
        self.enabled = enabled
        self.last = 0.0
        self.event: dict | None = None  # {"reason", "message", "posted"}: an Event for the watcher to relay

    def due(self) -> bool:
        return self.enabled and time.monotonic() - self.last >= EVERY_SECONDS

    def write(
        self,
        state: str,
        step: int = 0,
        tokens: int = 0,
        step_seconds: float = 0.0,
        last_checkpoint_step: int = 0,
        checkpoint=None,
    ) -> None:
        """state: running | saving | stopping | done | preempted | failed. `checkpoint`: the last save's
        SaveResult (app/trainer/checkpoint/writer.py): its whole time (what a stop waits for), of which the
        loop stood still for `blocking_seconds` and `write_seconds` ran in the background."""
        if not self.enabled:
            return
        self.last = time.monotonic()
        atomic_write_json(
            self.path,
            {
                "step": step,
                "tokens": tokens,
                "step_seconds": step_seconds,
                "checkpoint_seconds": checkpoint.seconds if checkpoint else 0.0,
                "checkpoint_blocking_seconds": checkpoint.blocking_seconds if checkpoint else 0.0,
                "checkpoint_write_seconds": checkpoint.write_seconds if checkpoint else 0.0,
                "last_checkpoint_step": max(last_checkpoint_step, 0),
                "state": state,
                **({"event": self.event} if self.event else {}),
                "pid": os.getpid(),
                "updated_unix": time.time(),
            },
            durable=False,  # a heartbeat: rename keeps it whole, losing one on a crash is fine
        )

    def fail_if_written(self) -> None:
        """A trainer that dies before its loop: a heartbeat an earlier process left at "running" must not
        go on telling the watcher so."""
        if self.path.exists():
            self.write("failed")
