"""Launch price guard (budget.max_price_per_gpu_hour): do not train while a GPU-hour costs more than this.
Unlike a budget stop, its stop is not final. docs/budget.md, "Launch price guard".
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from app.budget.files import clear_stale_budget_stop, write_stop_file
from app.budget.kube import KubeActions
from app.budget.ledger import LedgerLock, load_ledger, save_ledger
from app.budget.metrics import BudgetMetrics
from app.budget.pricing import local_price
from app.budget.sources import Reading, make_source, read_source
from app.budget.view import ledger_path_for
from app.config.budget import BudgetConfig
from app.errors import UserError

log = logging.getLogger("pretrain.budget")


class PriceAboveMax(Exception):
    """The price is above budget.max_price_per_gpu_hour at launch: exit 0 without training; str(e) says why."""


def current_price(reading: Reading, gpus: int, static_price: float) -> tuple[float | None, str]:
    """(USD per GPU-hour or None when unknown, where it came from)."""
    if reading.ok and reading.rate_usd_per_hour > 0:
        return reading.rate_usd_per_hour / max(gpus, 1), reading.source
    if static_price > 0:
        return static_price, "static price (the source gave no current rate)"
    return None, reading.source


def above_reason(price: float, ceiling: float, source: str, stage: str) -> str:
    return (
        f"price ${price:.4f}/GPU-h ({source}) is above budget.max_price_per_gpu_hour ${ceiling:.4f}; "
        f"{stage} until it drops"
    )


def record(run_dir: Path, entry: dict[str, Any], ledger: Any = None) -> None:
    """Put the guard's latest verdict in the ledger: the watcher's own copy when it runs, else the file
    (only when no sidecar holds it: that watcher will record its own verdict)."""
    if ledger is not None:
        ledger.price_guard = entry
        return
    path = ledger_path_for(run_dir)
    lock = LedgerLock(path)
    try:
        lock.acquire()
    except UserError:
        return
    try:
        led = load_ledger(path)
        led.price_guard = entry
        save_ledger(path, led)
    except (OSError, UserError) as e:
        log.warning("budget: cannot record the price guard in %s: %s", path, e)
    finally:
        lock.release()


def check_price_at_launch(cfg: BudgetConfig, run_dir: Path, world_size: int, is_rank0: bool) -> None:
    """Raise PriceAboveMax (exit 0, no training) when the price now is above the ceiling, if one is set."""
    ceiling = cfg.max_price_per_gpu_hour
    if ceiling <= 0:
        return
    _gpu_type, gpus, static_price = local_price(cfg, world_size)
    now = time.time()
    reading = make_source(cfg, static_price * gpus, now).read(now)
    price, source = current_price(reading, gpus, static_price)
    if price is None:
        if is_rank0:
            log.warning(
                "budget: no price to check against max_price_per_gpu_hour (%s); launching", reading.error
            )
        return
    above = price > ceiling
    reason = above_reason(price, ceiling, source, "not starting") if above else ""
    if is_rank0:
        record(
            run_dir,
            {
                "state": "not_started" if above else "ok",
                "price_per_gpu_hour": price,
                "max_price_per_gpu_hour": ceiling,
                "source": source,
                "reason": reason,
                "unix": now,
            },
        )
        if above and (kube := KubeActions.from_config(cfg)):
            kube.event("PriceAboveMax", reason)
    if above:
        raise PriceAboveMax(reason)


class PriceGuard:
    """The per-poll check, run by Watcher.tick with the reading it just took."""

    def __init__(self, cfg: BudgetConfig, gpus: int, static_price: float) -> None:
        self.ceiling, self.gpus, self.static_price = cfg.max_price_per_gpu_hour, gpus, static_price
        self.stopped = False

    def check(self, watcher: Any, reading: Reading, now: float) -> None:
        price, source = current_price(reading, self.gpus, self.static_price)
        m = watcher.metrics
        if m:
            m.max_price.set(self.ceiling)
            if price is not None:
                m.price.set(price)
            m.price_above.set(1 if price is not None and price > self.ceiling else 0)
        ledger = watcher.ledger  # None for a PriceWatcher: no budget, so no budget stop either
        if price is None or price <= self.ceiling or self.stopped or (ledger is not None and ledger.stop):
            return
        self.stopped = True
        reason = above_reason(price, self.ceiling, source, "stopping gracefully")
        write_stop_file(watcher.stop_file, "graceful", reason, now)
        record(
            watcher.run_dir,
            {
                "state": "stopped",
                "price_per_gpu_hour": price,
                "source": source,
                "max_price_per_gpu_hour": self.ceiling,
                "reason": reason,
                "unix": now,
            },
            ledger,
        )
        log.warning("budget price stop: %s", reason)
        if m:
            m.price_stops.inc()
        if watcher.kube:
            watcher.kube.event("PriceAboveMax", reason)


class PriceWatcher:
    """The in-process thread for a price ceiling without a cap: every `poll_seconds` it reads the source and
    runs the PriceGuard, nothing else (no ledger session). Same interface as Watcher for WatcherHandle."""

    def __init__(
        self, cfg: BudgetConfig, run_dir: Path, stop_file: Path, gpus: int, static_price: float
    ) -> None:
        self.metrics, self.kube = BudgetMetrics(), KubeActions.from_config(cfg)
        self.cfg, self.run_dir, self.stop_file = cfg, Path(run_dir), Path(stop_file)
        self.ledger, self.view = None, None  # no budget: no spend view; the guard records in the ledger file
        try:  # OpenCost's window starts at the run's first session
            start = load_ledger(ledger_path_for(self.run_dir)).created_unix or time.time()
        except UserError:
            start = time.time()
        self.source = make_source(cfg, static_price * gpus, start)
        self.price_guard = PriceGuard(cfg, gpus, static_price)
        clear_stale_budget_stop(self.stop_file)  # a leftover budget stop from an earlier run

    def tick(self, now: float) -> None:
        self.price_guard.check(self, read_source(self.source, now), now)
        self.metrics.last_poll.set(now)

    def run(self, stop_event: Any) -> str:
        while not stop_event.wait(self.cfg.poll_seconds):
            try:
                self.tick(time.time())
            except Exception:
                log.exception("budget: price check failed; retrying at the next poll")
        return "stopped"

    def close(self, now: float | None = None) -> None:
        """No final tick: the trainer has stopped, a stop file now would only be left behind."""
        self.metrics.shutdown()
