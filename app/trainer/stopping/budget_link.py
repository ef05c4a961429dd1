"""The training loop's one door to the budget (app.budget) and its watcher; the loop never touches the
budget's files.

At start every rank asks whether the price (`PriceAboveMax`) and the budget (`BudgetExhausted`) allow
training, so all agree, and rank 0 hosts the watcher thread unless a sidecar watches. At a checkpoint: the
spend so far (meta.json). Every few seconds on rank 0: whether the WSD decay should start (the answer goes
through the stop agreement, so every rank starts it at the same step), and the heartbeat the watcher
reads (status.json: app/trainer/stopping/heartbeat.py). And the trainer's own Events.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from app.budget import check_not_exhausted, check_price_at_launch, read_budget_state, start_in_process
from app.budget.kube import post_event
from app.config import Config
from app.trainer.stopping.heartbeat import Heartbeat
from app.trainer.stopping.planned_end import budget_decay_steps

READ_EVERY_SECONDS = 5.0
log = logging.getLogger("pretrain.budget")


class BudgetLink:
    def __init__(self, cfg: Config, run_dir: Path, stop_file: Path, is_rank0: bool, world_size: int) -> None:
        self.cfg, self.run_dir, self.rank0 = cfg, Path(run_dir), is_rank0
        self.enabled = cfg.budget.cap_usd > 0
        self.watcher = None
        self.last_read = 0.0
        self.heartbeat = Heartbeat(self.run_dir, enabled=is_rank0)  # what the watcher reads of the run
        check_price_at_launch(cfg.budget, self.run_dir, world_size, is_rank0)  # raises PriceAboveMax
        if self.enabled:
            check_not_exhausted(cfg.budget, self.run_dir)  # raises BudgetExhausted
        if is_rank0 and cfg.budget.in_process:
            # with no cap but a price ceiling, the thread checks the price alone at every poll
            self.watcher = start_in_process(cfg.budget, self.run_dir, stop_file, world_size)
        elif is_rank0 and not self.enabled and cfg.budget.max_price_per_gpu_hour > 0:
            log.warning(
                "budget: max_price_per_gpu_hour is checked at launch only: with budget.in_process=false and "
                "no cap no watcher runs (`pretrain watch` needs --budget-cap-usd); set budget.cap_usd to stop on a "
                "price rise mid-run"
            )

    def spent_usd(self, previous: float | None) -> float | None:
        state = read_budget_state(self.run_dir) if self.enabled else None
        return state.get("spent_usd") if state else previous

    def decay_proposal(self, step: int, step_seconds: float, decaying: bool) -> int:
        """Rank 0 proposes the budget-driven WSD decay (its length in steps) from the watcher's projection."""
        cfg = self.cfg
        if not (self.rank0 and self.enabled and cfg.schedule.name == "wsd" and not decaying):
            return 0
        now = time.monotonic()
        if now - self.last_read < READ_EVERY_SECONDS:
            return 0
        self.last_read = now
        state = read_budget_state(self.run_dir)
        if not state or state.get("seconds_to_stop") is None:
            return 0
        # seconds_to_stop: when the watcher's graceful stop fires (checkpoint and margin already reserved)
        return budget_decay_steps(
            step, float(state["seconds_to_stop"]), step_seconds, 0.0, cfg.budget.decay_fraction
        )

    def beat(
        self,
        status: str,
        step: int = 0,
        tokens: int = 0,
        step_seconds: float = 0.0,
        last_checkpoint_step: int = 0,
        checkpoint=None,
    ) -> None:
        """The heartbeat (rank 0): running | saving | stopping | done | preempted | failed, the progress, and
        the last committed save (`checkpoint`: its SaveResult), whose time the watcher reserves for the
        stop's save."""
        self.heartbeat.write(status, step, tokens, step_seconds, last_checkpoint_step, checkpoint)

    def beat_due(self) -> bool:
        """Whether the heartbeat is due again (every few seconds, rank 0)."""
        return self.heartbeat.due()

    def event(self, reason: str, message: str, warn) -> None:
        """A Warning Event on the job for a stop the budget watcher does not post itself (e.g. LowMFU):
        rank 0 posts it in a cluster; the heartbeat carries it too, and the watcher relays it when it was
        not posted."""
        posted = self.rank0 and post_event(self.cfg.budget, reason, message, warn)
        self.heartbeat.event = {"reason": reason, "message": message, "posted": posted}

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()  # idempotent
