"""Why a run stops, and how all ranks agree to stop at the same step: one host-side MAX agreement
(app/trainer/parallel/distributed.py) makes the most severe cause win on every rank. It runs every k steps
(train.stop_check_every) to keep its cost under 1% of the step time. Details: docs/architecture.md
("The stop protocol") and docs/performance.md ("The stop agreement and the preemption grace period").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import astuple, dataclass
from pathlib import Path

from app.errors import UserError
from app.files import check_writable_dir, not_a_stop_file, stop_file_of
from app.trainer.parallel.distributed import agree
from app.trainer.stopping.causes import SEVERITY, StopCause, StopDecision
from app.trainer.stopping.planned_end import DecayPlan, PlannedEnd

PROCESS_START = time.time()  # stop files older than this process are stale
AGREEMENT_SHARE = 0.01  # auto k: the agreement may cost this share of a step
MAX_STOP_DELAY = 2.0  # auto k: seconds a stop may wait for the next agreement


class SignalFlag:
    """Records SIGTERM/SIGINT instead of dying, so the loop can finish its step and checkpoint. Later
    signals change nothing: a second SIGTERM cannot interrupt a save (SIGKILL can; saves are atomic)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if not self.signum:
            self.signum = signum


def read_stop_file(path: Path, not_before: float = 0.0, warn=print) -> StopDecision | None:
    """A stop file's request. Anything that is not a well-formed request (e.g. `touch stop.json`, broken
    JSON, an unknown mode) still stops the run gracefully: someone asked for a stop. It is logged as
    cause "stop-file" with a warning for the malformed cases. A request stamped (`written_unix`) before
    `not_before` is stale, left by an earlier process: the budget case does not need it, since the
    trainer refuses to start when the ledger says stop."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        warn(f"warning: stop file {path} cannot be read ({e.strerror}); stopping gracefully")
        return _graceful(f"stop file {path} (unreadable): graceful stop")
    if not raw.strip():  # touched
        return _graceful(f"stop file {path}: graceful stop")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        warn(f"warning: stop file {path} is not a JSON object; stopping gracefully (see docs/contracts.md)")
        return _graceful(f"stop file {path} (not JSON): graceful stop")
    written = data.get("written_unix")
    if isinstance(written, (int, float)) and written < not_before:
        return None
    mode = str(data.get("mode", "graceful"))
    cause = str(data.get("cause") or "stop-file")
    reason = str(data.get("reason") or f"stop file {path}")
    if mode not in ("graceful", "immediate"):
        warn(
            f"warning: stop file {path} has unknown mode {mode!r} (graceful | immediate); stopping gracefully"
        )
        return _graceful(f"{cause}: {reason} (mode {mode!r}: graceful)")
    kind = StopCause.IMMEDIATE if mode == "immediate" else StopCause.BUDGET
    return StopDecision(kind, f"{cause}: {reason}", label=cause)


def check_stop_file(path: Path | None, run_dir: Path) -> None:
    """--stop-file at start: it must name a file, existing or not, in a directory that exists and is
    writable by this user (the watcher writes the file there, the trainer renames a handled one), or the
    stop would never arrive. A directory or a device would be read as a stop at step 0 and renamed
    NAME.handled; the default RUN_DIR/stop.json is checked for that too. UserError (exit 2). The run dir
    itself is the trainer's to create."""
    stop_file = stop_file_of(path, run_dir)
    problem = not_a_stop_file(stop_file)
    if problem and path:
        raise UserError(f"--stop-file {path} is {problem}; the trainer would take it for a stop request")
    if problem:
        raise UserError(
            f"the default stop file {stop_file} is {problem.split(':')[0]}, which the trainer would take for a "
            "stop request: move it away or pass --stop-file FILE"
        )
    if path is None:
        return
    folder = Path(path).parent
    if folder.resolve() == Path(run_dir).resolve():
        return
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise UserError(
            f"--stop-file {path}: {folder} {what}, so no stop request could ever be written there; create "
            "the directory or pass a path in one that exists"
        )
    check_writable_dir(folder, "--stop-file's directory", create=False)


def _graceful(reason: str) -> StopDecision:
    return StopDecision(StopCause.BUDGET, reason, label="stop-file")


class EarlyStopping:
    """Stop when val loss has not improved by min_delta for `patience` evals (0 = off)."""

    def __init__(self, patience: int, min_delta: float) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.best = float("inf")
        self.bad_evals = 0

    def update(self, val_loss: float) -> None:
        if val_loss < self.best - self.min_delta:
            self.best = val_loss
            self.bad_evals = 0
        else:
            self.bad_evals += 1

    def check(self) -> StopDecision | None:
        if self.patience and self.bad_evals >= self.patience:
            return StopDecision(
                StopCause.EARLY, f"early stop: no val-loss improvement in {self.bad_evals} evals"
            )
        return None

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        self.best = float(state["best"])
        self.bad_evals = int(state["bad_evals"])


class BadSteps:
    """Counts optimizer steps whose loss or gradient norm is not finite (their updates are skipped) and
    stops the run after `max_bad` in a row: NaN weights must never be saved, let alone as "best"."""

    def __init__(self, max_bad: int) -> None:
        self.max_bad = max_bad
        self.in_a_row = 0
        self.total = 0

    def update(self, finite: bool) -> bool:
        """Record a step; True when its update must be skipped."""
        if finite:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.total += 1
        return True

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row = int(state["in_a_row"])
        self.total = int(state["total"])

    def check(self) -> StopDecision | None:
        if self.in_a_row >= self.max_bad:
            return StopDecision(
                StopCause.DIVERGED,
                f"diverged: {self.in_a_row} steps in a row with a non-finite loss or gradient (updates "
                "skipped); lower optim.lr or raise schedule.warmup_steps, then resume from the last "
                "checkpoint",
            )
        return None


class MfuFloor:
    """train.mfu_floor: a run whose MFU stays under the floor for `minutes` after warm-up stops (checkpoint,
    exit 7), so a mis-configured job or a degraded node pool does not spend the budget at half speed. The
    first `warmup_windows` throughput windows of a process (compile, caches, the first eval) do not count."""

    def __init__(self, floor: float, minutes: float, warmup_windows: int = 3) -> None:
        self.floor = floor
        self.seconds = minutes * 60
        self.warmup = warmup_windows
        self.low_since: float | None = None
        self.last = 0.0

    def update(self, mfu: float | None, now: float) -> None:
        """One throughput window's MFU (None: unknown)."""
        if not self.floor or mfu is None:
            return
        if self.warmup > 0:
            self.warmup -= 1
            return
        self.last = mfu
        if mfu >= self.floor:
            self.low_since = None
        elif self.low_since is None:
            self.low_since = now

    def check(self, now: float) -> StopDecision | None:
        if self.low_since is None or now - self.low_since < self.seconds:
            return None
        minutes = (now - self.low_since) / 60
        return StopDecision(
            StopCause.LOW_MFU,
            f"MFU {self.last:.1%} under train.mfu_floor={self.floor:g} for {minutes:.1f} min after warm-up; "
            "check micro-batch size, compile, data wait and the node (GPU dashboard), then resume",
        )


def auto_every(agreement_seconds: float, step_seconds: float) -> int:
    """k for train.stop_check_every=0: the agreement under AGREEMENT_SHARE of the steps it covers, a stop
    delayed by at most MAX_STOP_DELAY seconds (or one step, when a step is longer)."""
    by_cost = math.ceil(agreement_seconds / (AGREEMENT_SHARE * step_seconds))
    return max(1, min(by_cost, int(MAX_STOP_DELAY / step_seconds)))


@dataclass
class Ballot:
    """What a rank puts into the agreement, as host integers; every rank takes each field's MAX over ranks."""

    stop: int  # its most severe stop cause (StopDecision.encode; 0: go on)
    decay_steps: int  # the budget's WSD decay proposal (rank 0's; 0: none)
    clock_steps: int  # max_hours: the steps to its planned end (PlannedEnd.clock_proposal; 0: none yet)
    save: int  # 1: checkpoint.every_minutes passed on its clock
    every: int  # its proposal for k, the steps between agreements (train.stop_check_every=0: auto)

    def agreed(self) -> Ballot:
        """Collective: every rank's ballot, field by field the MAX."""
        return Ballot(*agree(list(astuple(self))))


@dataclass
class Agreement:
    """What the ranks agreed at one step."""

    decision: StopDecision  # stop or go on (StopCause.NONE)
    plan: DecayPlan | None = None  # a newly agreed end plan (the budget's decay, max_hours' end); no start_lr
    save_now: bool = False  # a rank found checkpoint.every_minutes passed


class StopAgreement:
    """Collects this rank's causes and agrees with the other ranks once per step."""

    def __init__(
        self,
        *,
        stop_file: Path | None,
        planned: PlannedEnd,
        early: EarlyStopping,
        signals: SignalFlag,
        bad_steps: BadSteps,
        mfu_floor: MfuFloor | None = None,
        every: int = 0,
        warn=print,
        say=print,
    ) -> None:
        self.stop_file = stop_file  # None on ranks that do not watch it (in Kubernetes: not the master pod)
        self.planned = planned
        self.early = early
        self.signals = signals
        self.bad_steps = bad_steps
        self.mfu_floor = mfu_floor or MfuFloor(0.0, 0.0)
        self.warn = warn
        self.say = say
        self.fixed_every = every  # 0: auto
        self.every = max(every, 1)  # agreed by all ranks
        self.costs: list[float] = []  # seconds of the recent agreements
        self.agreed_once = False

    def local(self, step: int, tokens: int, elapsed: float) -> StopDecision:
        candidates = [
            self.planned.check(step, tokens, elapsed),
            self.early.check(),
            self.bad_steps.check(),
            self.mfu_floor.check(time.monotonic()),
            read_stop_file(self.stop_file, PROCESS_START, self.warn) if self.stop_file else None,
        ]
        if self.signals.signum:
            name = signal.Signals(self.signals.signum).name
            candidates.append(StopDecision(StopCause.PREEMPTED, f"preempted: {name}", self.signals.signum))
        found = [c for c in candidates if c is not None]
        return max(found, key=lambda d: d.encode()) if found else StopDecision(StopCause.NONE)

    def agree(
        self,
        step: int,
        tokens: int,
        elapsed: float,
        decay_proposal: int = 0,
        want_save: bool = False,
        step_seconds: float = 0.0,
    ) -> Agreement:
        """The decision every rank takes, a newly agreed end plan (or None) and whether to save a checkpoint
        now. The plan: the budget's WSD decay (`decay_proposal`, rank 0's) or max_hours' end
        (PlannedEnd.clock_proposal), without its start_lr (the schedule adds it: Schedule.follow).
        Time-based choices (checkpoint every M minutes, max hours) differ by a few ms between ranks' clocks,
        so they go through the same agreement: any rank asking is enough. Between agreements (see the
        module docstring) only the causes every rank sees alike are looked at."""
        alike = [self.planned.check(step, tokens, 0.0), self.early.check(), self.bad_steps.check()]
        if self.agreed_once and step % self.every and not any(alike):
            return Agreement(StopDecision(StopCause.NONE))
        self.agreed_once = True
        mine = self.local(step, tokens, elapsed)
        ballot = Ballot(
            stop=mine.encode(),
            decay_steps=decay_proposal,
            clock_steps=self.planned.clock_proposal(step, tokens, elapsed),
            save=int(want_save),
            every=self._k(step_seconds),
        )
        start = time.perf_counter()
        agreed = ballot.agreed()
        self.costs = [*self.costs[-15:], time.perf_counter() - start]
        if agreed.every != self.every:
            self.say(
                f"stop agreement: every {agreed.every} steps (cost {min(self.costs) * 1e3:.2f} ms, "
                f"step {step_seconds * 1e3:.1f} ms; a stop waits up to {agreed.every} steps)"
            )
        self.every = agreed.every
        plan = None
        if agreed.decay_steps:  # the budget's first, should both come at once
            plan = DecayPlan(step, agreed.decay_steps, "budget")
        elif agreed.clock_steps:
            hours = self.planned.max_seconds / 3600
            plan = DecayPlan(step, agreed.clock_steps, "max_hours", hours=hours)
        decision = mine
        if agreed.stop != mine.encode():
            cause = SEVERITY[agreed.stop // 1000]
            detail = agreed.stop % 1000
            decision = StopDecision(cause, f"{cause.name.lower()} (agreed with another rank)", detail)
        return Agreement(decision, plan, bool(agreed.save))

    def _k(self, step_seconds: float) -> int:
        """This rank's proposal for k. The cheapest recent agreement is its cost: a longer one waited for
        a slower rank, which a rarer agreement would not save (the gradient all-reduce waits instead)."""
        if self.fixed_every or not self.costs or step_seconds <= 0:
            return self.every
        return auto_every(min(self.costs), step_seconds)

    def consume_stop_file(self) -> None:
        """Move a handled stop file aside so a later restart of the same run dir is not stopped by it."""
        if self.stop_file is not None:
            with contextlib.suppress(OSError):
                os.replace(self.stop_file, self.stop_file.with_name(self.stop_file.name + ".handled"))
