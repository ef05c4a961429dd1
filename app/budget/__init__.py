"""Budget guard: a run never spends more than its cap and ends on a finished checkpoint.

The trainer's entry points:
  - `start_in_process(cfg, run_dir, stop_file, world_size)` when budget.in_process is true: refuses a run whose
    budget is already spent (BudgetExhausted), else runs the watcher loop in a daemon thread; call
    `.close()` on exit.
  - `check_not_exhausted(cfg, run_dir)` when a sidecar (`pretrain watch`) does the watching.
  - `check_price_at_launch(cfg, run_dir, world_size, is_rank0)`: the launch price guard (PriceAboveMax).
  - `read_budget_state(run_dir)`: the watcher's latest view (budget/state.json) for the budget-aware LR decay.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from app.budget.config import BudgetConfig, check_budget_config
from app.budget.kube import KubeActions
from app.budget.ledger import load_ledger
from app.budget.metrics import BudgetMetrics
from app.budget.price_guard import PriceAboveMax, PriceGuard, PriceWatcher, check_price_at_launch
from app.budget.pricing import detect_cuda_gpu_type, no_price_error, resolve_gpus, static_rate
from app.budget.view import View, ledger_path_for, read_budget_state
from app.budget.watcher import Watcher
from app.errors import UserError

__all__ = [
    "BudgetConfig",
    "BudgetExhausted",
    "PriceAboveMax",
    "WatcherHandle",
    "check_not_exhausted",
    "check_price_at_launch",
    "read_budget_state",
    "resolve_gpus",
    "start_in_process",
]

log = logging.getLogger("pretrain.budget")


class BudgetExhausted(Exception):
    """The run's budget is spent (or its budget stop was reached): exit 0 at once; str(e) is the line to print."""


def check_not_exhausted(cfg: BudgetConfig, run_dir: Path) -> None:
    """Raise BudgetExhausted when the ledger shows the cap spent, or a budget stop already decided under
    this cap (a restart after a graceful budget stop must not train on). No cap: nothing to check."""
    if cfg.cap_usd <= 0:
        return
    path = ledger_path_for(Path(run_dir))
    led = load_ledger(path)
    spent, cap = led.effective_spent(), cfg.cap_usd
    if spent >= cap:
        raise BudgetExhausted(
            f"budget exhausted: ${spent:.4f} spent of the ${cap:.4f} cap ({path}); "
            f"nothing to train; raise --budget-cap-usd to continue"
        )
    if led.stop and cap <= led.stop.cap_usd * (1 + 1e-9):
        raise BudgetExhausted(
            f"budget stop already reached: ${spent:.4f} spent of the ${cap:.4f} cap "
            f"({led.stop.mode} stop, not enough left for another step and checkpoint); "
            f"raise --budget-cap-usd to continue"
        )


class WatcherHandle:
    """The in-process watcher thread; `close()` stops it and flushes the ledger (idempotent)."""

    def __init__(self, watcher: Watcher | PriceWatcher | None):
        self.watcher = watcher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if watcher is not None:
            self._thread = threading.Thread(
                target=watcher.run, args=(self._stop,), name="budget-watcher", daemon=True
            )
            self._thread.start()

    @property
    def view(self) -> View | None:
        return self.watcher.view if self.watcher else None

    def close(self) -> None:
        if self.watcher is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.watcher.cfg.poll_seconds + 30)
        self.watcher.close(time.time())
        self.watcher = None


def start_in_process(cfg: BudgetConfig, run_dir: Path, stop_file: Path, world_size: int) -> WatcherHandle:
    """Host the watcher in the trainer (rank 0). Raises BudgetExhausted, or UserError for a bad config.
    Without a cap but with budget.max_price_per_gpu_hour, the thread runs the per-poll price check alone."""
    if cfg.cap_usd <= 0 and cfg.max_price_per_gpu_hour <= 0:
        return WatcherHandle(None)
    check_budget_config(cfg)
    gpu_type = cfg.gpu_type or detect_cuda_gpu_type()
    gpus = resolve_gpus(cfg, world_size)
    rate, price = static_rate(gpu_type, cfg.price_per_gpu_hour, gpus, cfg.price_table)
    run_dir, stop_file = Path(run_dir), Path(stop_file)
    watcher: Watcher | PriceWatcher
    if cfg.cap_usd > 0:
        if rate <= 0 and cfg.source == "static":
            raise no_price_error(gpu_type)
        check_not_exhausted(cfg, run_dir)
        watcher = open_watcher(cfg, run_dir, stop_file, rate, price, gpus, "in-process")
    else:  # a price ceiling without a cap: poll the source for the price alone
        watcher = PriceWatcher(cfg, run_dir, stop_file, gpus, price)
    watcher.tick(time.time())  # the first view (or price) and any stop right away, before training starts
    if cfg.metrics_port:
        try:
            watcher.metrics.serve(cfg.metrics_port)
        except OSError as e:
            watcher.close()
            msg = f"budget metrics port {cfg.metrics_port} is not available ({e.strerror})"
            raise UserError(f"{msg}; set budget.metrics_port") from None
    if isinstance(watcher, Watcher):
        log.info(
            "budget: watching in-process: cap $%.4f, %s at $%.2f/h, ledger %s",
            cfg.cap_usd,
            cfg.source,
            watcher.view.rate_usd_per_hour if watcher.view else rate,
            watcher.ledger_path,
        )
    else:
        log.info(
            "budget: no cap; checking the price against max_price_per_gpu_hour $%.4f every %g s (%s source)",
            cfg.max_price_per_gpu_hour,
            cfg.poll_seconds,
            cfg.source,
        )
    return WatcherHandle(watcher)


def open_watcher(
    cfg: BudgetConfig,
    run_dir: Path,
    stop_file: Path,
    rate: float,
    price: float,
    gpus: int,
    host: str,
    ledger_path: Path | None = None,
) -> Watcher:
    """A Watcher with its metrics, Kubernetes actions and, with budget.max_price_per_gpu_hour, the price
    guard; not ticked yet (`pretrain watch` and start_in_process)."""
    kube = KubeActions.from_config(cfg)
    watcher = Watcher(
        cfg,
        run_dir=run_dir,
        stop_file=stop_file,
        static_rate_usd_per_hour=rate,
        ledger_path=ledger_path,
        host=host,
        metrics=BudgetMetrics(),
        kube=kube,
    )
    if cfg.max_price_per_gpu_hour > 0:
        watcher.price_guard = PriceGuard(cfg, gpus, price)
    return watcher
