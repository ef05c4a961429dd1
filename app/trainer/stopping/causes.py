"""Why a run stops (StopCause), which cause wins when ranks disagree (SEVERITY) and what a stop does
(StopDecision: its exit code, whether it saves, its gauge code). Decided in app/trainer/stopping/agreement.py and
app/trainer/stopping/planned_end.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from app.errors import EXIT_DIVERGED, EXIT_LOW_MFU


class StopCause(IntEnum):
    NONE = 0
    PLANNED = 1  # max steps / tokens / hours reached
    EARLY = 2  # val loss stopped improving
    BUDGET = 3  # graceful stop file (budget watcher or a user)
    PREEMPTED = 4  # SIGTERM / SIGINT
    IMMEDIATE = 5  # immediate stop file: exit now, no checkpoint
    DIVERGED = 6  # train.max_bad_steps non-finite steps in a row: save the last good weights, exit 3
    LOW_MFU = 8  # train.mfu_floor: MFU stayed under the floor after warm-up; checkpoint, exit 7


# Which cause wins when ranks disagree (the agreement takes the MAX of these positions): a low MFU is a
# graceful stop, below a preemption, an immediate stop and divergence (values are the gauge's codes).
SEVERITY = (
    StopCause.NONE,
    StopCause.PLANNED,
    StopCause.EARLY,
    StopCause.BUDGET,
    StopCause.LOW_MFU,
    StopCause.PREEMPTED,
    StopCause.IMMEDIATE,
    StopCause.DIVERGED,
)


@dataclass
class StopDecision:
    cause: StopCause
    reason: str = ""
    detail: int = 0  # the signal number for PREEMPTED
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
        return 7 if self.cause == StopCause.BUDGET and self.name != "budget" else int(self.cause)

    @property
    def exit_code(self) -> int:
        """0: done, Kubernetes must not restart; 128 + signal: preempted, the ExitCode policy retries."""
        if self.cause == StopCause.PREEMPTED:
            return 128 + self.detail
        return {StopCause.DIVERGED: EXIT_DIVERGED, StopCause.LOW_MFU: EXIT_LOW_MFU}.get(self.cause, 0)

    @property
    def event(self) -> str:
        """The reason of the Kubernetes Event the trainer posts for this stop ("" for none: the budget
        watcher and the launcher post the others)."""
        return "LowMFU" if self.cause == StopCause.LOW_MFU else ""

    def encode(self) -> int:
        return SEVERITY.index(self.cause) * 1000 + self.detail
