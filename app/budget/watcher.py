"""The budget watcher: poll the source, charge the ledger, apply the policy, tell the trainer.

One implementation, two hosts: `pretrain watch` (a sidecar process) and the trainer's in-process thread
both run `Watcher.run`. `tick(now)` takes the time as an argument so tests drive it with a simulated clock;
`due(now)` and `wait_seconds(now)` say when the next tick is wanted (the simulator follows them too).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from app.budget.files import clear_stale_budget_stop, read_status, write_stop_file
from app.budget.kube import KubeActions
from app.budget.ledger import Ledger, LedgerLock, Session, StopRecord, load_ledger, save_ledger
from app.budget.metrics import BudgetMetrics
from app.budget.policy import TRAINER_FIGURES, Decision, PolicyInput, decide, policy_input
from app.budget.sources import Reading, make_source, read_source
from app.budget.view import View, ledger_path_for
from app.config.budget import BudgetConfig
from app.errors import UserError
from app.files import atomic_write_json

log = logging.getLogger("pretrain.budget")

RESERVE_POLLS = 2.0  # a session killed without closing is charged this many polls of spend
TRAINING_STATES = ("running", "saving", "stopping", "preempted")  # status.json states of a started trainer
FALLBACK_LOG_SECONDS = 600.0  # repeat a persisting source failure in the log this often
LOOK_SECONDS = 0.1  # read status.json this often between polls (docs/budget.md, "Looks between polls")
LEASE_FILE = (
    "lease.json"  # held by a trainer for its whole life (app/trainer/stopping/lease.py, docs/contracts.md)
)
# the View's fields that are the policy's figures, as given (spend, rate, timings) or decided (state, ...)
POLICY_FIELDS = {f.name for f in (*fields(PolicyInput), *fields(Decision))}
FROM_POLICY = [f.name for f in fields(View) if f.name in POLICY_FIELDS]


class Watcher:
    def __init__(
        self,
        cfg: BudgetConfig,
        *,
        run_dir: Path,
        stop_file: Path,
        static_rate_usd_per_hour: float,
        ledger_path: Path | None = None,
        host: str = "sidecar",
        metrics: BudgetMetrics | None = None,
        kube: KubeActions | None = None,
        now: float | None = None,
        lock: bool = True,
    ):
        if cfg.cap_usd <= 0:
            raise UserError("the budget watcher needs a cap: --budget-cap-usd X (budget.cap_usd) with X > 0")
        now = time.time() if now is None else now
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.stop_file = Path(stop_file)
        self.ledger_path = Path(ledger_path) if ledger_path else ledger_path_for(self.run_dir)
        self.state_path = self.ledger_path.with_name("state.json")
        self.status_path = self.run_dir / "status.json"
        self.static_rate = static_rate_usd_per_hour
        self.host, self.metrics, self.kube = host, metrics, kube
        self._lock = LedgerLock(self.ledger_path)  # release() is a no-op when not acquired
        if lock:
            self._lock.acquire()
        try:
            self.ledger = self._open_session(load_ledger(self.ledger_path), now)
            save_ledger(self.ledger_path, self.ledger)
        except BaseException as e:
            self._lock.release()
            if isinstance(e, OSError):
                msg = f"cannot write the budget ledger {self.ledger_path}: {e.strerror}; check the volume"
                raise UserError(msg) from None
            raise
        self.source = make_source(cfg, static_rate_usd_per_hour, self.ledger.created_unix)
        self.session_start = self._last = now
        self._good_rate = self.ledger.rate_usd_per_hour if self.ledger.source == cfg.source else 0.0
        self._fallback, self._last_error, self._last_log = False, "", -float("inf")  # see _charge
        stop = self.ledger.stop
        self._immediate_seen = now if stop and stop.mode == "immediate" else None
        # done at most once a session: suspend, relay the trainer's Event, say "unbilled", say "waiting"
        self._suspend_done = self._relayed = self._said_unbilled = self._said_waiting = False
        self._stopped_at_open = stop is not None
        self._closed = False
        self.next_tick_unix = now  # when the next regular tick is due (tick() moves it on)
        self._status_seen: float | None = None  # updated_unix of the last status.json a decision used
        self.fallbacks = 0
        self.view: View | None = None
        self.price_guard = None  # a PriceGuard when budget.max_price_per_gpu_hour is set
        if stop:  # a new pod has a new (empty) stop-file volume: say it again
            write_stop_file(self.stop_file, stop.mode, stop.reason, now)

    # ------------------------------------------------------------ session

    def _open_session(self, led: Ledger, now: float) -> Ledger:
        cap = self.cfg.cap_usd
        if led.open_session:
            led.spent_usd += led.reserved_usd
            led.crashes += 1
            if led.sessions and not led.sessions[-1].end_unix:
                led.sessions[-1].end_unix = led.updated_unix
                led.sessions[-1].spent_usd += led.reserved_usd
            log.warning(
                "budget: the previous watcher session ended without closing (killed?); charged its reserve $%.4f",
                led.reserved_usd,
            )
        led.reserved_usd = 0.0
        if not led.created_unix:
            led.created_unix = now
        if led.stop and cap > led.stop.cap_usd * (1 + 1e-9):
            log.warning(
                "budget: cap raised from $%.4f to $%.4f; the earlier budget stop is lifted",
                led.stop.cap_usd,
                cap,
            )
            led.stop = None
        if not led.stop:  # a budget stop file left by an earlier run (or a lower cap) must not stop this one
            clear_stale_budget_stop(self.stop_file)
        led.cap_usd = cap
        led.sessions.append(Session(start_unix=now, host=self.host, pid=os.getpid()))
        led.open_session = True
        led.updated_unix = now
        return led

    def close(self, now: float | None = None) -> None:
        """Charge up to now, close the session, flush the ledger; idempotent."""
        if self._closed:
            return
        now = time.time() if now is None else now
        try:
            self.tick(now)
        except Exception:
            log.exception("budget: final tick failed; closing the ledger with the last figures")
        led = self.ledger
        led.open_session = False
        led.reserved_usd = 0.0
        led.sessions[-1].end_unix = now  # this session's (opened in __init__)
        led.sessions[-1].clean = True
        try:
            save_ledger(self.ledger_path, led)
        finally:
            self._closed = True
            self._lock.release()
            if self.metrics:
                self.metrics.shutdown()

    # ------------------------------------------------------------ one poll

    def _charge(self, reading: Reading, dt: float, now: float) -> tuple[float, float]:
        """New spend and rate from the reading; falls back to the static rate when the source fails."""
        led = self.ledger
        if reading.ok:
            if self._fallback:
                log.warning("budget: source %s is healthy again", reading.source)
            self._fallback, self._last_error = False, ""
            if reading.spent_usd is None:  # static: integrate the rate over the time we ran
                rate = reading.rate_usd_per_hour
                return led.spent_usd + rate * dt / 3600, rate
            if reading.rate_usd_per_hour > 0:
                self._good_rate = reading.rate_usd_per_hour
            rate = reading.rate_usd_per_hour or self.static_rate
            estimate = (
                reading.spent_usd - led.unbilled_usd + rate * max(0.0, now - reading.updated_unix) / 3600
            )
            return max(led.spent_usd, estimate), rate
        rate = max(self.static_rate, self._good_rate)
        if not self._fallback:
            self.fallbacks += 1
            if self.metrics:
                self.metrics.fallbacks.inc()
        # "stale: 304 s ago" and "stale: 324 s ago" are one kind of failure: logged once, not every poll
        kind = re.sub(r"[0-9.]+", "#", reading.error)
        if not self._fallback or kind != self._last_error or now - self._last_log >= FALLBACK_LOG_SECONDS:
            log.warning(
                "budget: source %s failed (%s); falling back to the static rate $%.2f/h",
                reading.source,
                reading.error,
                rate,
            )
            self._last_log = now
        self._fallback, self._last_error = True, kind
        spent = led.spent_usd + rate * dt / 3600
        if reading.spent_usd is not None:  # a stale figure is still a lower bound
            spent = max(spent, reading.spent_usd - led.unbilled_usd)
        return spent, rate

    # ------------------------------------------------------------ when to look

    def _in_session(self, status: Any, states: tuple[str, ...] = TRAINING_STATES) -> bool:
        """status.json is from this session's trainer, in one of `states` (default: in its training loop)."""
        return bool(status and status.state in states and status.updated_unix >= self.session_start - 1)

    def due(self, now: float) -> bool:
        """A tick is wanted now: its time has come, or status.json changed since the last decision and,
        with its figures and the spend extrapolated at the last rate, the policy would ask for a stop.
        Cheap: one small file read, no source read, nothing written."""
        if now >= self.next_tick_unix:
            return True
        status = read_status(self.status_path)
        seen = status.updated_unix if status else None
        if seen == self._status_seen:
            return False
        self._status_seen = seen
        led = self.ledger
        spent = led.spent_usd + led.rate_usd_per_hour * max(0.0, now - self._last) / 3600
        return bool(decide(self._policy_input(spent, led.rate_usd_per_hour, status, now)).stop)

    def wait_seconds(self, now: float) -> float:
        """How long the loop may sleep before asking `due` again: LOOK_SECONDS at most."""
        return min(max(0.0, self.next_tick_unix - now), LOOK_SECONDS)

    def _policy_input(self, spent: float, rate: float, status: Any, now: float) -> PolicyInput:
        # a trainer that holds the run dir (its lease) but has not reported training in this session yet
        starting = not self._in_session(status) and (self.run_dir / LEASE_FILE).exists()
        return policy_input(self.cfg, self.ledger, spent, rate, status, now, starting)

    # ------------------------------------------------------------ the tick

    def tick(self, now: float) -> View:
        led, cfg = self.ledger, self.cfg
        dt = max(0.0, now - self._last)
        self._last = now
        reading = read_source(self.source, now)
        status = read_status(self.status_path)
        self._status_seen = status.updated_unix if status else None
        if not led.trained_unix and self._in_session(status):
            led.trained_unix = now
        spent, rate = self._charge(reading, dt, now)
        if not led.trained_unix:
            spent = self._idle(spent, dt, now)
        led.sessions[-1].spent_usd += spent - led.spent_usd
        led.spent_usd = spent
        led.running_seconds += dt
        led.rate_usd_per_hour = rate
        led.reserved_usd = rate * RESERVE_POLLS * cfg.poll_seconds / 3600
        led.source = reading.source
        led.updated_unix = now
        inp = self._policy_input(spent, rate, status, now)
        for key in TRAINER_FIGURES:  # the ledger keeps the last known, for projections after a restart
            setattr(led, key, getattr(inp, key))
        dec = decide(inp)
        self._act(dec, now)
        self.next_tick_unix = now + dec.look_again_seconds
        if dec.waiting_for_trainer and not self._said_waiting:
            self._said_waiting = True
            log.warning(
                "budget: $%.4f left of the $%.4f cap; the graceful stop waits for the trainer's first "
                "training step (asked now, it would stop before step 1 with nothing saved)",
                dec.remaining_usd,
                cfg.cap_usd,
            )
        if self.price_guard:
            self.price_guard.check(self, reading, now)
        policy = {**vars(inp), **vars(dec)}
        view = View(
            **{name: policy[name] for name in FROM_POLICY},
            source=reading.source,
            source_healthy=reading.ok,
            updated_unix=now,
            stop_mode=led.stop.mode if led.stop else "",
            source_error=reading.error,
            source_updated_unix=reading.updated_unix,
        )
        save_ledger(self.ledger_path, led)
        atomic_write_json(self.state_path, asdict(view), durable=False)
        if self.metrics:
            self.metrics.update(view)
        self._escalate(now, status)
        self._relay_event(status)
        self.view = view
        return view

    def _idle(self, spent: float, dt: float, now: float) -> float:
        """The trainer has never reported training: charge the wait up to the idle allowance, keep the rest
        apart (ledger unbilled_usd), and say so once a session."""
        led, cfg = self.ledger, self.cfg
        billable = min(dt, max(0.0, cfg.idle_allowance_seconds - led.idle_seconds))
        led.idle_seconds += dt
        if dt <= 0 or billable >= dt:
            return spent
        unbilled = max(0.0, spent - led.spent_usd) * (dt - billable) / dt
        led.unbilled_usd += unbilled
        led.unbilled_seconds += dt - billable
        if not self._said_unbilled:
            self._said_unbilled = True
            msg = (
                f"budget: the trainer has not started training after {led.idle_seconds / 60:.0f} min "
                f"(budget.idle_allowance_seconds={cfg.idle_allowance_seconds:g}); further waiting is not "
                f"charged to the ${cfg.cap_usd:.2f} cap but recorded in the ledger as unbilled_usd "
                f"(${led.unbilled_usd:.4f} so far): look at the wait-for-data and trainer logs"
            )
            log.warning("%s", msg)
            if self.kube:
                self.kube.event("BudgetIdleNotBilled", msg)
        return spent - unbilled

    # ------------------------------------------------------------ actions

    def _act(self, dec: Decision, now: float) -> None:
        led, cap = self.ledger, self.cfg.cap_usd
        if dec.alert and abs(led.alerted_cap_usd - cap) > 1e-12 and not dec.stop:
            led.alerted_cap_usd = cap
            msg = (
                f"budget alert: ${led.spent_usd:.4f} spent of the ${cap:.4f} cap ({led.spent_usd / cap:.0%})"
            )
            log.warning("%s", msg)
            if self.metrics:
                self.metrics.alerts.inc()
            if self.kube:
                self.kube.event("BudgetAlert", msg)
        if not dec.stop:
            return
        led.alerted_cap_usd = cap
        write_stop_file(self.stop_file, dec.stop, dec.reason, now)
        led.stop = StopRecord(dec.stop, dec.reason, cap, led.spent_usd, now)
        if dec.stop == "immediate":
            self._immediate_seen = now
        log.warning("budget %s stop: %s", dec.stop, dec.reason)
        if self.metrics:
            self.metrics.stops.labels(mode=dec.stop).inc()
        if self.kube:
            self.kube.event(
                "BudgetGracefulStop" if dec.stop == "graceful" else "BudgetImmediateStop", dec.reason
            )

    def _relay_event(self, status: Any) -> None:
        """The trainer's own Event (status.json `event`, e.g. LowMFU) when it could not post it itself."""
        ev = status.event if status and self._in_session(status, ("done", "preempted")) else None
        if ev and not ev.get("posted") and self.kube and not self._relayed:
            self._relayed = bool(self.kube.event(str(ev.get("reason")), str(ev.get("message"))))

    def _escalate(self, now: float, status: Any) -> None:
        """Last resort: the trainer still heartbeats `suspend_grace_seconds` after an immediate stop."""
        seen = self._immediate_seen
        if seen is None or self._suspend_done or now - seen < self.cfg.suspend_grace_seconds:
            return
        if status is None or status.state == "done" or status.updated_unix <= seen:
            return
        self._suspend_done = True
        waited = now - seen
        then = f"suspending the {self.kube.kind}" if self.kube else "no Kubernetes access: stop it by hand"
        log.error("budget: the trainer still runs %.0f s after an immediate stop; %s", waited, then)
        if self.kube and self.kube.suspend():
            if self.metrics:
                self.metrics.suspends.inc()
            self.kube.event(
                "BudgetSuspended",
                f"trainer ignored an immediate budget stop for {waited:.0f} s; job suspended",
            )

    # ------------------------------------------------------------ the loop (both hosts)

    def finished(self, now: float) -> str:
        """Why a sidecar may exit now, or "": the trainer reported done in this session, or the budget was
        already stopped when we started and no trainer heartbeat appeared within the grace period."""
        status = read_status(self.status_path)
        if self._in_session(status, ("done",)):
            return "the trainer is done"
        if (
            self._stopped_at_open
            and now - self.session_start >= self.cfg.suspend_grace_seconds
            and (status is None or status.updated_unix < self.session_start)
        ):
            return "the budget was already stopped and no trainer is running"
        return ""

    def run(self, stop_event: threading.Event, exit_when_done: bool = False) -> str:
        """Poll until stop_event is set (or, with exit_when_done, until `finished`); never dies on a tick.
        The host ticked once on start; then every poll_seconds, or sooner when the policy wants (`due`)."""
        if self.next_tick_unix <= self.session_start:  # no tick yet: the first one after a whole poll
            self.next_tick_unix = self.session_start + self.cfg.poll_seconds
        while not self._sleep(stop_event):
            try:
                self.tick(time.time())
            except Exception:
                log.exception("budget: watcher tick failed; retrying at the next poll")
                self.next_tick_unix = time.time() + self.cfg.poll_seconds
            if exit_when_done and (why := self.finished(time.time())):
                return why
        return "stopped"

    def _sleep(self, stop_event: threading.Event) -> bool:
        """Sleep until `due`; True when stop_event was set meanwhile."""
        while True:
            if stop_event.wait(self.wait_seconds(time.time())):
                return True
            try:
                if self.due(time.time()):
                    return False
            except Exception:  # a look must not kill the watcher either: fall back to the poll
                log.exception("budget: looking at status.json failed; ticking now")
                return False
