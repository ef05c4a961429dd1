"""The training loop's one door to the budget (app.budget): the loop asks three questions and never
touches the budget's files itself.

- at start: is the budget already spent? (`BudgetExhausted`, every rank reads the ledger so all agree);
  is the price above budget.max_price_per_gpu_hour? (`PriceAboveMax`); rank 0 also hosts the watcher
  thread unless a sidecar watches (with no cap but a price ceiling, the thread checks the price alone);
- at a checkpoint: what has been spent so far? (recorded in meta.json);
- every few seconds on rank 0: should the WSD decay start now? (from the watcher's projection; the
  answer goes through the stop agreement so every rank starts the decay at the same step).
It also posts the trainer's own Kubernetes Events (app/budget/kube.py holds the client).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from app.config import Config
from app.trainer.schedule import budget_decay_steps

READ_EVERY_SECONDS = 5.0
log = logging.getLogger("pretrain.budget")


class BudgetLink:
    def __init__(self, cfg: Config, run_dir: Path, stop_file: Path, is_rank0: bool, world_size: int) -> None:
        self.cfg, self.run_dir, self.rank0 = cfg, Path(run_dir), is_rank0
        self.enabled = cfg.budget.cap_usd > 0
        self.watcher = None
        self.last_read = 0.0
        if cfg.budget.max_price_per_gpu_hour > 0:
            from app.budget import check_price_at_launch

            check_price_at_launch(cfg.budget, self.run_dir, world_size, is_rank0)  # raises PriceAboveMax
        guard_only = not self.enabled and cfg.budget.max_price_per_gpu_hour > 0
        if not (self.enabled or guard_only):
            return
        from app.budget import check_not_exhausted, start_in_process

        if self.enabled:
            check_not_exhausted(cfg.budget, self.run_dir)  # raises BudgetExhausted
        if is_rank0 and cfg.budget.in_process:
            # with no cap, the thread checks the price alone at every poll
            self.watcher = start_in_process(cfg.budget, self.run_dir, stop_file, world_size)
        elif is_rank0 and guard_only:
            log.warning(
                "budget: max_price_per_gpu_hour is checked at launch only: with budget.in_process=false and "
                "no cap no watcher runs (`pretrain watch` needs --cap-usd); set budget.cap_usd to stop on a "
                "price rise mid-run"
            )

    def _state(self) -> dict | None:
        from app.budget import read_budget_state

        return read_budget_state(self.run_dir)

    def spent_usd(self, previous: float | None) -> float | None:
        state = self._state() if self.enabled else None
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
        state = self._state()
        if not state or state.get("seconds_to_stop") is None:
            return 0
        # seconds_to_stop: when the watcher's graceful stop fires (checkpoint and margin already reserved)
        return budget_decay_steps(
            step, float(state["seconds_to_stop"]), step_seconds, 0.0, cfg.budget.decay_fraction
        )

    def event(self, reason: str, message: str, warn) -> bool:
        """A Warning Event on the job (a stop the budget watcher does not post, e.g. LowMFU), in a cluster;
        True when posted (else the watcher relays it from status.json)."""
        from app.budget.kube import post_event

        return post_event(self.cfg.budget, reason, message, warn)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
