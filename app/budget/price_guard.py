"""Launch price guard (budget.max_price_per_gpu_hour): do not train while a GPU-hour costs more than this.

"If the spot price is above $1.40/h at launch, do not launch." The price per GPU-hour is the budget
source's rate divided by the GPUs billed: the static price (budget.price_per_gpu_hour or the table), the
billing file's `rate_usd_per_hr`, or OpenCost's rate. A source that cannot say (failed, stale, no rate
yet) falls back to the static price; with none, the guard lets the run go and says so.

- At start (every rank reads the source, so all agree; before any work): above the ceiling, the trainer
  does not start and exits 0, a deliberate wait, not a failure (no crash-loop, and a re-run later
  launches when the price is back under it).
- At each poll of the budget watcher (in-process thread or sidecar, with budget.cap_usd > 0), or of a
  `PriceWatcher` (the in-process thread without a cap: the price check alone, no spend tracking): above
  the ceiling, a graceful stop (checkpoint, exit 0). Unlike a budget stop it is not final: the next
  launch checks the price again.

Either way the ledger (`price_guard`), a Kubernetes Event (PriceAboveMax) and the watcher's metrics
(pretrain_budget_price_per_gpu_hour, pretrain_budget_price_above_max, pretrain_budget_price_stops_total)
say why.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from app.budget.config import BudgetConfig
from app.budget.files import clear_stale_budget_stop, write_stop_file
from app.budget.kube import KubeActions
from app.budget.ledger import LedgerLock, load_ledger, save_ledger
from app.budget.metrics import BudgetMetrics
from app.budget.pricing import detect_cuda_gpu_type, resolve_gpus, static_rate
from app.budget.sources import Reading, make_source, read_source
from app.budget.view import ledger_path_for
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
    """Raise PriceAboveMax (exit 0, no training) when the price now is above budget.max_price_per_gpu_hour
    (no ceiling: nothing to check)."""
    ceiling = cfg.max_price_per_gpu_hour
    if ceiling <= 0:
        return
    gpus = resolve_gpus(cfg, world_size)
    gpu_type = cfg.gpu_type or detect_cuda_gpu_type()
    _rate, static_price = static_rate(gpu_type, cfg.price_per_gpu_hour, gpus, cfg.price_table)
    now = time.time()
    reading = make_source(cfg, static_price * gpus, now).read(now)
    price, source = current_price(reading, gpus, static_price)
    if price is None:
        if is_rank0:
            log.warning(
                "budget: no price to check against max_price_per_gpu_hour (%s); launching", reading.error
            )
        return
    entry = {"state": "ok", "price_per_gpu_hour": price, "max_price_per_gpu_hour": ceiling, "source": source,
             "reason": "", "unix": now}  # fmt: skip
    if price <= ceiling:
        if is_rank0:
            record(run_dir, entry)
        return
    reason = above_reason(price, ceiling, source, "not starting")
    if is_rank0:
        record(run_dir, {**entry, "state": "not_started", "reason": reason})
        kube = KubeActions.from_config(cfg)
        if kube:
            kube.event("PriceAboveMax", reason)
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
        record(watcher.run_dir, {"state": "stopped", "price_per_gpu_hour": price, "source": source,
                                 "max_price_per_gpu_hour": self.ceiling, "reason": reason, "unix": now},
               ledger)  # fmt: skip
        log.warning("budget price stop: %s", reason)
        if m:
            m.price_stops.inc()
        if watcher.kube:
            watcher.kube.event("PriceAboveMax", reason)


class PriceWatcher:
    """The in-process thread for budget.max_price_per_gpu_hour without a cap (budget.cap_usd=0): every
    `poll_seconds` it reads the source and runs the PriceGuard, nothing else (no spend, no ledger session:
    the verdict goes into the ledger file under its lock). Same interface as Watcher for WatcherHandle."""

    def __init__(
        self, cfg: BudgetConfig, run_dir: Path, stop_file: Path, gpus: int, static_price: float
    ) -> None:
        self.metrics, self.kube = BudgetMetrics(), KubeActions.from_config(cfg)
        self.cfg, self.run_dir, self.stop_file = cfg, Path(run_dir), Path(stop_file)
        self.ledger = None
        self.view = None
        self.ledger_path = ledger_path_for(self.run_dir)
        now = time.time()
        try:
            start = load_ledger(self.ledger_path).created_unix or now
        except UserError:
            start = now
        self.source = make_source(cfg, static_price * gpus, start)
        self.price_guard = PriceGuard(cfg, gpus, static_price)
        clear_stale_budget_stop(self.stop_file)  # a leftover budget stop from an earlier run

    def tick(self, now: float) -> None:
        self.price_guard.check(self, read_source(self.source, now), now)
        if self.metrics:
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
        if self.metrics:
            self.metrics.shutdown()
