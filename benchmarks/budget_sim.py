"""A training job under the real watcher, on a simulated clock: the evidence that the policy keeps runs
under their cap and ends them gracefully. Used by the tests and the benchmark.

Everything the watcher touches is real (ledger, status.json, stop file, billing file, policy); only time is
simulated and the trainer is a state machine: its lease on the run dir from the first moment, startup, steps,
periodic checkpoints, the stop file checked before the first step and after every step (a stop seen before
step 1 saves nothing, as in app/train.py), SIGTERM (finish the step, checkpoint, exit) or SIGKILL
preemptions, restarts after downtime (not billed), and a billing poller that lags, goes missing, writes
garbage or freezes. The watcher ticks when it is due, as in `Watcher.run`: at `next_tick_unix`, and at its
look at status.json (every LOOK_SECONDS) after each heartbeat, taken here at the latest such look.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from app.budget import BudgetExhausted, check_not_exhausted
from app.budget.files import read_stop_file
from app.budget.ledger import load_ledger
from app.budget.view import ledger_path_for
from app.budget.watcher import LEASE_FILE, LOOK_SECONDS, Watcher
from app.config.budget import BudgetConfig
from app.files import atomic_write_json

T0 = 1_700_000_000.0  # simulated unix epoch, so ISO timestamps in the billing file are real ones


@dataclass
class SimParams:
    seed: int
    rate_usd_per_hour: float
    cap_usd: float
    step_seconds: float
    checkpoint_seconds: float
    checkpoint_every_seconds: float
    startup_seconds: float
    poll_seconds: float
    margin_seconds: float = 60.0
    step_jitter: float = 0.2
    checkpoint_jitter: float = 0.3
    source: str = "static"  # static | file
    file_update_seconds: float = 60.0
    file_lag_seconds: float = 0.0
    outages: list[tuple[float, float, str]] = field(
        default_factory=list
    )  # (start, end, missing|malformed|frozen)
    rate_change: tuple[float, float] | None = (
        None  # (at sim second, factor): billing rate changes (file only)
    )
    preempt_uptimes: list[tuple[float, str]] = field(default_factory=list)  # (total uptime s, sigterm|kill)
    downtime_seconds: float = 600.0

    @classmethod
    def random(
        cls, seed: int, hours: tuple[float, float] = (1.0, 6.0), poll: tuple[float, float] = (10, 60)
    ) -> SimParams:
        """A random job: rate, cap (hours of it), step and checkpoint times, source failures, preemptions."""
        rng = random.Random(seed)
        rate = rng.uniform(0.5, 50.0)  # USD/h for the whole job
        hours = rng.uniform(*hours)
        run_seconds = hours * 3600
        source = rng.choice(["static", "file"])
        outages = []
        for _ in range(rng.randint(0, 3)):
            start = rng.uniform(0, run_seconds * 1.2)
            outages.append(
                (start, start + rng.uniform(60, 1800), rng.choice(["missing", "malformed", "frozen"]))
            )
        preempts = [
            (rng.uniform(0.02, 1.02) * run_seconds, rng.choice(["sigterm", "kill"]))
            for _ in range(rng.randint(0, 3))
        ]
        return cls(
            seed=seed,
            rate_usd_per_hour=rate,
            cap_usd=rate * hours,
            step_seconds=math.exp(rng.uniform(math.log(0.5), math.log(20.0))),
            checkpoint_seconds=rng.uniform(1.0, 90.0),
            checkpoint_every_seconds=rng.uniform(300, 1800),
            startup_seconds=rng.uniform(5, 120),
            poll_seconds=rng.uniform(*poll),
            source=source,
            file_update_seconds=rng.uniform(20, 120),
            file_lag_seconds=rng.uniform(0, 30),
            outages=sorted(outages),
            rate_change=(rng.uniform(0, run_seconds), rng.uniform(0.7, 1.1))
            if source == "file" and rng.random() < 0.5
            else None,
            preempt_uptimes=sorted(preempts),
            downtime_seconds=rng.uniform(60, 3600),
        )

    @classmethod
    def random_timing(cls, seed: int) -> SimParams:
        """A job that stresses the graceful window: random poll (1-120 s), margin (0-30 s), step
        (0.05-30 s) and checkpoint (0.5-120 s) times, and a cap from below one step plus one checkpoint
        up to a few hours; static rate, no preemptions (the window, not recovery, is under test)."""
        rng = random.Random(seed)
        step = math.exp(rng.uniform(math.log(0.05), math.log(30.0)))
        ckpt = math.exp(rng.uniform(math.log(0.5), math.log(120.0)))
        startup = rng.uniform(1.0, 60.0)
        rate = rng.uniform(0.5, 50.0)
        work = math.exp(rng.uniform(math.log(0.3 * (step + ckpt)), math.log(4 * 3600.0)))
        return cls(
            seed=seed,
            rate_usd_per_hour=rate,
            cap_usd=rate * (startup + work) / 3600,
            step_seconds=step,
            checkpoint_seconds=ckpt,
            checkpoint_every_seconds=rng.uniform(60.0, 1800.0),
            startup_seconds=startup,
            poll_seconds=rng.uniform(1.0, 120.0),
            margin_seconds=rng.uniform(0.0, 30.0),
        )

    def affords_step_and_checkpoint(self) -> bool:
        """ "Affordable": the cap pays for the start-up, the watcher's look at the trainer's first heartbeat
        (`LOOK_SECONDS`), one step and one checkpoint, the step and the checkpoint at their slowest (base
        time x (1 + jitter)). Below that no budget stop can end on a checkpoint: a stop seen before step 1
        saves nothing, and one seen after it needs the step and the checkpoint."""
        need = (
            self.startup_seconds
            + LOOK_SECONDS
            + self.step_seconds * (1 + self.step_jitter)
            + self.checkpoint_seconds * (1 + self.checkpoint_jitter)
        )
        return self.cap_usd >= self.rate_usd_per_hour * need / 3600


@dataclass
class SimResult:
    params: SimParams
    true_spent_usd: float
    ledger_spent_usd: float
    end: str  # graceful | graceful-killed | immediate | refused
    segments: list[tuple[float, str]]  # (remaining USD at the segment's start, how it ended)
    restart_refused: bool  # a restart after the end exits at once
    fallbacks: int
    checkpoints: int
    lost_steps: int = 0  # steps trained after the last checkpoint when the job ended (work thrown away)
    # the watcher knew the step and checkpoint times (measured, or from the ledger) when it asked the first
    # budget stop; before the first checkpoint it can only assume one fits in poll + allowance
    stop_priced: bool = False

    @property
    def fraction(self) -> float:
        return self.true_spent_usd / self.params.cap_usd

    def graceful_was_possible(self) -> bool:
        """The last segment started with room for startup, two steps and checkpoints, a poll and the margin."""
        p = self.params
        need = (
            p.startup_seconds
            + 2 * (p.step_seconds + p.checkpoint_seconds) * 1.5
            + p.poll_seconds
            + p.margin_seconds
        )
        return self.segments[-1][0] >= p.rate_usd_per_hour * 1.1 * need / 3600


class _Trainer:
    def __init__(self, job: SimJob, now: float):
        self.job = job
        self.phase, self.phase_end = "startup", now + job.p.startup_seconds
        self.exiting = ""  # graceful | sigterm
        self.steps_since_ckpt = 0
        self.last_ckpt = now
        self.step_avg = job.step_avg
        self.last_status = -math.inf

    def write_status(self, now: float, force: bool = False) -> None:
        if not force and now - self.last_status < 30.0:
            return
        self.last_status = now
        data = {
            "step": self.job.steps,
            "tokens": 0,
            "step_seconds": self.step_avg,
            "checkpoint_seconds": self.job.ckpt_last,
            "last_checkpoint_step": 0,
            "state": "running",
            "pid": 1,
            "updated_unix": now,
        }
        atomic_write_json(self.job.status_path, data, durable=False)
        self.job.status_unix = now

    def stop_request(self) -> str:
        if not self.job.stop_path.exists():
            return ""
        data = read_stop_file(self.job.stop_path) or {}
        return str(data.get("mode", ""))

    def _start(self, phase: str, now: float) -> None:
        rng, p = self.job.rng, self.job.p
        if phase == "step":
            d = p.step_seconds * (1 + rng.uniform(-p.step_jitter, p.step_jitter))
        else:
            d = p.checkpoint_seconds * (1 + rng.uniform(-p.checkpoint_jitter, p.checkpoint_jitter))
        self.phase, self.phase_end, self.phase_len = phase, now + d, d

    def _after_work(self, now: float) -> str:
        """At a step boundary: what the trainer does next; returns an end reason or ""."""
        mode = self.stop_request()
        if mode == "immediate":
            return "immediate"
        if self.exiting or mode == "graceful":
            self.exiting = (
                "graceful" if mode == "graceful" else self.exiting
            )  # budget end wins over preemption
            if self.steps_since_ckpt == 0:
                return self.exiting
            self._start("checkpoint", now)
            return ""
        if now - self.last_ckpt >= self.job.p.checkpoint_every_seconds and self.steps_since_ckpt:
            self._start("checkpoint", now)
        else:
            self._start("step", now)
        return ""

    def on_phase_end(self, now: float) -> str:
        if self.phase == "startup":
            self.write_status(now, force=True)
            return self._after_work(now)
        if self.phase == "step":
            self.job.steps += 1
            self.steps_since_ckpt += 1
            self.step_avg = (
                self.phase_len if not self.step_avg else 0.8 * self.step_avg + 0.2 * self.phase_len
            )
            self.job.step_avg = self.step_avg
            self.write_status(now)
            return self._after_work(now)
        # checkpoint done
        self.job.ckpt_last = self.phase_len
        self.job.checkpoints += 1
        self.steps_since_ckpt = 0
        self.last_ckpt = now
        self.write_status(now, force=True)
        if self.exiting:
            return self.exiting
        return self._after_work(now)

    def sigterm(self, now: float) -> str:
        if self.phase == "startup":
            return "sigterm"
        if not self.exiting:
            self.exiting = "sigterm"
        return ""


class SimJob:
    def __init__(self, p: SimParams, root: Path):
        self.p = p
        self.rng = random.Random(p.seed * 7919 + 1)
        self.root = Path(root)
        self.run_dir = self.root / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.status_path = self.run_dir / "status.json"
        self.stop_path = self.run_dir / "stop.json"
        self.billing_path = self.root / "billing.json"
        self.cfg = BudgetConfig(
            cap_usd=p.cap_usd,
            price_per_gpu_hour=p.rate_usd_per_hour,
            gpus=1,
            source=p.source,
            source_path=str(self.billing_path),
            poll_seconds=p.poll_seconds,
            stale_seconds=max(300.0, 3 * p.file_update_seconds),
            margin_seconds=p.margin_seconds,
            kube="off",
        )
        self.t = T0
        self.up = False
        self.true_spent = 0.0
        self.uptime = 0.0
        self.steps = 0
        self.checkpoints = 0
        self.step_avg = 0.0
        self.ckpt_last = 0.0
        self.history: list[tuple[float, float, bool]] = []  # (t, true spent, pod up) for the billing poller
        self.fallbacks = 0
        self.lost_steps = 0
        self.status_unix = -math.inf  # the trainer's last heartbeat
        self.stop_priced: bool | None = None  # set at the first budget stop

    # ------------------------------------------------------------ true spend

    def rate_at(self, t: float) -> float:
        rc = self.p.rate_change
        if rc and t - T0 >= rc[0]:
            return self.p.rate_usd_per_hour * rc[1]
        return self.p.rate_usd_per_hour

    def advance(self, t: float) -> None:
        if t < self.t:
            return
        if self.up:
            rc = self.p.rate_change
            a = self.t
            if rc and a < T0 + rc[0] < t:
                self.true_spent += self.rate_at(a) * (T0 + rc[0] - a) / 3600
                a = T0 + rc[0]
            self.true_spent += self.rate_at(a) * (t - a) / 3600
            self.uptime += t - self.t
        self.t = t
        self.history.append((t, self.true_spent, self.up))

    # ------------------------------------------------------------ billing poller

    def billed_at(self, t: float) -> tuple[float, float]:
        """(true spend, rate) at a past time t, as a billing system would know it."""
        for ht, hs, up in reversed(self.history):
            if ht <= t:
                return (hs + self.rate_at(ht) * (t - ht) / 3600, self.rate_at(t)) if up else (hs, 0.0)
        return 0.0, 0.0

    def poll_billing(self, t: float) -> None:
        outage = next((kind for a, b, kind in self.p.outages if T0 + a <= t < T0 + b), "")
        if outage == "frozen":
            return
        if outage == "missing":
            self.billing_path.unlink(missing_ok=True)
            return
        if outage == "malformed":
            self.billing_path.write_text('{"spent_usd": "lots", ')
            return
        at = t - self.p.file_lag_seconds
        spent, rate = self.billed_at(at)
        data = {
            "spent_usd": spent,
            "rate_usd_per_hr": rate,
            "hours_elapsed": max(0.0, at - T0) / 3600,
            "projected_total_usd": self.p.cap_usd,
            "last_update_utc": datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        }
        atomic_write_json(self.billing_path, data, durable=False)

    # ------------------------------------------------------------ the run

    def _tick(self, watcher: Watcher, t: float) -> None:
        watcher.tick(t)
        led = watcher.ledger
        if led.stop and self.stop_priced is None:
            self.stop_priced = led.step_seconds > 0 and led.checkpoint_seconds > 0

    def run(self) -> SimResult:
        p = self.p
        next_bill = T0
        preempts = list(p.preempt_uptimes)
        segments: list[tuple[float, str]] = []
        end = ""
        restart_at = T0
        while True:
            # ---- (re)start a pod
            while next_bill <= restart_at:
                self.advance(next_bill)
                self.poll_billing(next_bill)
                next_bill += p.file_update_seconds
            self.advance(restart_at)
            try:
                check_not_exhausted(self.cfg, self.run_dir)
            except BudgetExhausted:
                if not end:  # the stop was decided, then a preemption got in first
                    stop = load_ledger(ledger_path_for(self.run_dir)).stop
                    last = segments[-1][1] if segments else ""
                    if stop and stop.mode == "graceful" and last == "sigterm":
                        end = "graceful"  # SIGTERM checkpointed, which is all a graceful stop does
                    else:
                        end = f"{stop.mode}-killed" if stop else "refused"
                restart_refused = True
                break
            if end:  # a budget stop ended the job, yet a restart was allowed
                restart_refused = False
                break
            self.up = True
            self.history.append((self.t, self.true_spent, True))
            remaining = p.cap_usd - load_ledger(ledger_path_for(self.run_dir)).effective_spent()
            lease = self.run_dir / LEASE_FILE  # the trainer takes it before anything else (app/train.py)
            atomic_write_json(lease, {"owner": "sim", "pid": 1, "heartbeat_unix": self.t}, durable=False)
            watcher = Watcher(
                self.cfg,
                run_dir=self.run_dir,
                stop_file=self.stop_path,
                static_rate_usd_per_hour=p.rate_usd_per_hour,
                host="sim",
                now=self.t,
                lock=False,
            )
            trainer = _Trainer(self, self.t)
            self._tick(watcher, self.t)  # the first tick as the pod starts
            look = math.inf  # the watcher's look at status.json after the trainer's last heartbeat
            reason = ""
            while not reason:
                pre_t = T0 + math.inf
                if preempts:
                    pre_t = self.t + (preempts[0][0] - self.uptime)
                t = min(watcher.next_tick_unix, look, trainer.phase_end, next_bill, pre_t)
                self.advance(t)
                if t == next_bill:
                    self.poll_billing(t)
                    next_bill += p.file_update_seconds
                elif t in (watcher.next_tick_unix, look):
                    if t == look:
                        look = math.inf
                    if watcher.due(t):
                        self._tick(watcher, t)
                elif t == pre_t:
                    _, kind = preempts.pop(0)
                    reason = "kill" if kind == "kill" else trainer.sigterm(t)
                else:
                    heartbeat = self.status_unix
                    reason = trainer.on_phase_end(t)
                    if self.status_unix != heartbeat:
                        look = min(look, self.status_unix + LOOK_SECONDS)
            self.fallbacks += watcher.fallbacks
            self.up = False
            self.history.append((self.t, self.true_spent, False))
            self.lost_steps = trainer.steps_since_ckpt
            if reason != "kill":
                lease.unlink(missing_ok=True)  # released on exit; a killed trainer leaves it behind
                watcher.close(self.t)  # the sidecar exits with the pod and flushes
            if reason == "kill" and trainer.exiting == "graceful":
                reason = "graceful-killed"
            segments.append((remaining, reason))
            if reason in ("graceful", "immediate", "graceful-killed"):
                end = reason
            restart_at = self.t + p.downtime_seconds
        led = load_ledger(ledger_path_for(self.run_dir))
        return SimResult(
            params=p,
            true_spent_usd=self.true_spent,
            ledger_spent_usd=led.effective_spent(),
            end=end,
            segments=segments,
            restart_refused=restart_refused,
            fallbacks=self.fallbacks,
            checkpoints=self.checkpoints,
            lost_steps=self.lost_steps,
            stop_priced=bool(self.stop_priced),
        )


def simulate(seed: int, root: Path, params: SimParams | None = None) -> SimResult:
    root = Path(root) / f"sim{seed}"
    try:
        return SimJob(params or SimParams.random(seed), root).run()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summary(results: list[SimResult]) -> dict[str, float]:
    fr = [r.fraction for r in results]
    return {
        "runs": len(results),
        "mean": sum(fr) / len(fr),
        "min": min(fr),
        "max": max(fr),
        "graceful": sum(r.end == "graceful" for r in results),
    }


if __name__ == "__main__":  # quick look: python -m benchmarks.budget_sim
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        res = [simulate(s, Path(d)) for s in range(20)]
        print(json.dumps(summary(res)))
