"""Why a run stops, and how all ranks agree to stop at the same step.

Every rank computes a local stop code each step; one agreement (app/trainer/distributed.py: MAX over
three integers, on the host, over gloo) gives every rank the same decision: the most severe cause wins.
The other two carry a proposal for the budget-driven LR decay (steps left) and a request to checkpoint
now. It costs one small round trip of the host per step and never waits for the GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from app.trainer.distributed import agree

PROCESS_START = time.time()  # stop files older than this process are stale
EXIT_DIVERGED = 3  # permanent (1-127) under the PyTorchJob ExitCode policy: a restart would diverge again
STOP_FILE_MODES = ("graceful", "immediate")


class StopCause(IntEnum):
    NONE = 0
    PLANNED = 1  # max steps / tokens / hours reached
    EARLY = 2  # val loss stopped improving
    BUDGET = 3  # graceful stop file (budget watcher or a user)
    PREEMPTED = 4  # SIGTERM / SIGINT
    IMMEDIATE = 5  # immediate stop file: exit now, no checkpoint
    DIVERGED = 6  # train.max_bad_steps non-finite steps in a row: save the last good weights, exit 3


@dataclass
class StopDecision:
    cause: StopCause
    detail: int = 0  # the signal number for PREEMPTED
    reason: str = ""
    label: str = ""  # how logs name the cause; default: the cause's name (a stop file names its own)

    @property
    def name(self) -> str:
        return self.label or self.cause.name.lower()

    @property
    def stops(self) -> bool:
        return self.cause != StopCause.NONE

    @property
    def saves(self) -> bool:
        return self.cause not in (StopCause.NONE, StopCause.IMMEDIATE)

    @property
    def planned_or_early(self) -> bool:
        return self.cause in (StopCause.PLANNED, StopCause.EARLY)

    @property
    def consumes_stop_file(self) -> bool:
        """A handled budget or immediate request is moved aside, so a restart is not stopped by it."""
        return self.cause in (StopCause.BUDGET, StopCause.IMMEDIATE)

    @property
    def gauge_code(self) -> int:
        """pretrain_stop_state: the cause, except 7 for a graceful stop file not written by the budget
        watcher (a user's `touch`, or a malformed request), so a dashboard does not call it a budget stop."""
        if self.cause == StopCause.BUDGET and self.name != "budget":
            return 7
        return int(self.cause)

    @property
    def exit_code(self) -> int:
        """0: done, Kubernetes must not restart; 128 + signal: preempted, the ExitCode policy retries."""
        if self.cause == StopCause.PREEMPTED:
            return 128 + self.detail
        if self.cause == StopCause.DIVERGED:
            return EXIT_DIVERGED
        return 0

    def encode(self) -> int:
        return int(self.cause) * 1000 + self.detail


class SignalFlag:
    """Records SIGTERM/SIGINT instead of dying, so the loop can finish its step and checkpoint.

    Later signals are recorded too but change nothing: a second SIGTERM during a save cannot
    interrupt it. Only SIGKILL can, and saves are atomic, so that leaves the previous checkpoint.
    """

    def __init__(self) -> None:
        self.signum = 0
        self.count = 0
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self.count += 1
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
        return StopDecision(StopCause.BUDGET, 0, f"stop file {path} (unreadable): graceful stop", "stop-file")
    if not raw.strip():  # touched
        return StopDecision(StopCause.BUDGET, 0, f"stop file {path}: graceful stop", "stop-file")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        warn(f"warning: stop file {path} is not a JSON object; stopping gracefully (see docs/contracts.md)")
        return StopDecision(StopCause.BUDGET, 0, f"stop file {path} (not JSON): graceful stop", "stop-file")
    written = data.get("written_unix")
    if isinstance(written, (int, float)) and written < not_before:
        return None
    mode = str(data.get("mode", "graceful"))
    cause = str(data.get("cause") or "stop-file")
    reason = str(data.get("reason") or f"stop file {path}")
    if mode not in STOP_FILE_MODES:
        warn(
            f"warning: stop file {path} has unknown mode {mode!r} (graceful | immediate); stopping gracefully"
        )
        return StopDecision(StopCause.BUDGET, 0, f"{cause}: {reason} (mode {mode!r}: graceful)", "stop-file")
    if mode == "immediate":
        return StopDecision(StopCause.IMMEDIATE, 0, f"{cause}: {reason}", cause)
    return StopDecision(StopCause.BUDGET, 0, f"{cause}: {reason}", cause)


@dataclass
class PlannedEnd:
    max_steps: int
    max_tokens: int = 0
    max_seconds: float = 0.0  # over all restarts of the run

    def check(self, step: int, tokens: int, elapsed_seconds: float) -> StopDecision | None:
        if step >= self.max_steps:
            return StopDecision(StopCause.PLANNED, 0, f"planned end: reached max_steps={self.max_steps}")
        if self.max_tokens and tokens >= self.max_tokens:
            return StopDecision(StopCause.PLANNED, 0, f"planned end: reached max_tokens={self.max_tokens}")
        if self.max_seconds and elapsed_seconds >= self.max_seconds:
            hours = self.max_seconds / 3600
            return StopDecision(StopCause.PLANNED, 0, f"planned end: reached max_hours={hours:g}")
        return None

    def seconds_left(
        self, step: int, tokens: int, elapsed: float, step_seconds: float, tokens_per_second: float
    ) -> float:
        """Time to the planned end at the current pace (whichever limit comes first)."""
        left = [(self.max_steps - step) * step_seconds]
        if self.max_tokens and tokens_per_second > 0:
            left.append((self.max_tokens - tokens) / tokens_per_second)
        if self.max_seconds:
            left.append(self.max_seconds - elapsed)
        return max(0.0, min(left))


class EarlyStopping:
    """Stop when val loss has not improved by min_delta for `patience` evals (0 = off)."""

    def __init__(self, patience: int, min_delta: float) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best = float("inf")
        self.bad_evals = 0

    def update(self, val_loss: float) -> None:
        if val_loss < self.best - self.min_delta:
            self.best, self.bad_evals = val_loss, 0
        else:
            self.bad_evals += 1

    def check(self) -> StopDecision | None:
        if self.patience and self.bad_evals >= self.patience:
            return StopDecision(
                StopCause.EARLY, 0, f"early stop: no val-loss improvement in {self.bad_evals} evals"
            )
        return None

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad_evals = float(state["best"]), int(state["bad_evals"])


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
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])

    def check(self) -> StopDecision | None:
        if self.in_a_row >= self.max_bad:
            return StopDecision(
                StopCause.DIVERGED,
                0,
                f"diverged: {self.in_a_row} steps in a row with a non-finite loss or gradient (updates skipped); "
                "lower optim.lr or raise schedule.warmup_steps, then resume from the last checkpoint",
            )
        return None


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
        warn=print,
    ) -> None:
        self.stop_file = stop_file  # None on ranks that do not watch it (in Kubernetes: not the master pod)
        self.planned, self.early, self.signals, self.bad_steps, self.warn = (
            planned,
            early,
            signals,
            bad_steps,
            warn,
        )

    def local(self, step: int, tokens: int, elapsed: float) -> StopDecision:
        candidates = [
            self.planned.check(step, tokens, elapsed),
            self.early.check(),
            self.bad_steps.check(),
            read_stop_file(self.stop_file, PROCESS_START, self.warn) if self.stop_file else None,
        ]
        if self.signals.signum:
            name = signal.Signals(self.signals.signum).name
            candidates.append(StopDecision(StopCause.PREEMPTED, self.signals.signum, f"preempted: {name}"))
        found = [c for c in candidates if c is not None]
        return max(found, key=lambda d: d.encode()) if found else StopDecision(StopCause.NONE)

    def agree(
        self, step: int, tokens: int, elapsed: float, decay_proposal: int = 0, want_save: bool = False
    ) -> tuple[StopDecision, int, bool]:
        """(the decision every rank takes, the agreed budget-decay length or 0, save a checkpoint now).
        Time-based choices (checkpoint every M minutes, max hours) differ by a few ms between ranks'
        clocks, so they go through the same agreement: any rank asking is enough."""
        mine = self.local(step, tokens, elapsed)
        code, decay, save = agree([mine.encode(), decay_proposal, int(want_save)])
        if code == mine.encode():
            return mine, decay, bool(save)
        cause, detail = StopCause(code // 1000), code % 1000
        return (
            StopDecision(cause, detail, f"{cause.name.lower()} (agreed with another rank)"),
            decay,
            bool(save),
        )

    def consume_stop_file(self) -> None:
        """Move a handled stop file aside so a later restart of the same run dir is not stopped by it."""
        if self.stop_file is not None:
            with contextlib.suppress(OSError):
                os.replace(self.stop_file, self.stop_file.with_name(self.stop_file.name + ".handled"))
