"""Budget guard: a run never spends more than its cap and ends on a finished checkpoint (docs/budget.md).

The trainer reaches it through app/trainer/stopping/budget_link.py: the launch checks (`check_not_exhausted`,
`check_price_at_launch`), the in-process watcher thread (`start_in_process`) and `read_budget_state`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from app.budget.kube import KubeActions
from app.budget.ledger import load_ledger
from app.budget.metrics import BudgetMetrics
from app.budget.price_guard import PriceAboveMax, PriceGuard, PriceWatcher, check_price_at_launch
from app.budget.pricing import local_price, no_price_error, resolve_gpus
from app.budget.view import View, ledger_path_for, read_budget_state
from app.budget.watcher import Watcher
from app.config.budget import BudgetConfig, check_budget_config
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
    path = ledger_path_for(run_dir)
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
    gpu_type, gpus, price = local_price(cfg, world_size)
    if cfg.cap_usd <= 0:  # a price ceiling without a cap: poll the source for the price alone
        price_watcher = PriceWatcher(cfg, run_dir, stop_file, gpus, price)
        start_watching(price_watcher, cfg.metrics_port)
        log.info(
            "budget: no cap; checking the price against max_price_per_gpu_hour $%.4f every %g s (%s source)",
            cfg.max_price_per_gpu_hour,
            cfg.poll_seconds,
            cfg.source,
        )
        return WatcherHandle(price_watcher)
    if price <= 0 and cfg.source == "static":
        raise no_price_error(gpu_type)
    check_not_exhausted(cfg, run_dir)
    watcher = open_watcher(
        cfg,
        gpus,
        price,
        run_dir=run_dir,
        stop_file=stop_file,
        static_rate_usd_per_hour=price * gpus,
        host="in-process",
    )
    start_watching(watcher, cfg.metrics_port)
    log.info(
        "budget: watching in-process: cap $%.4f, %s at $%.2f/h, ledger %s",
        cfg.cap_usd,
        cfg.source,
        watcher.view.rate_usd_per_hour,
        watcher.ledger_path,
    )
    return WatcherHandle(watcher)


def open_watcher(cfg: BudgetConfig, gpus: int, price: float, **where: Any) -> Watcher:
    """A Watcher (`where`: Watcher's run_dir, stop_file, static rate, host...) with its metrics, Kubernetes
    actions and, with budget.max_price_per_gpu_hour, the price guard; not ticked yet."""
    watcher = Watcher(cfg, metrics=BudgetMetrics(), kube=KubeActions.from_config(cfg), **where)
    if cfg.max_price_per_gpu_hour > 0:
        watcher.price_guard = PriceGuard(cfg, gpus, price)
    return watcher


def start_watching(watcher: Watcher | PriceWatcher, port: int, addr: str = "") -> None:
    """The first tick (real figures, and any stop, before training and the first scrape), then /metrics
    on `port` (0 = off); the watcher is closed again when either fails."""
    try:
        watcher.tick(time.time())
        if port:
            try:
                port = watcher.metrics.serve(port, addr)
            except OSError as e:
                raise UserError(
                    f"budget metrics port {port} is not available ({e.strerror}); "
                    "set budget.metrics_port (--metrics-port)"
                ) from None
            log.info("budget: metrics on :%d/metrics", port)
    except BaseException:
        watcher.close()
        raise
