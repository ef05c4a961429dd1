"""The budget policy: given what is spent and how fast, when to alert, stop gracefully, or stop at once.

Pure arithmetic, no I/O, so the same rules run in the watcher and in the simulated-clock tests.

With r the rate in USD/s and R = (cap - spent) / r the seconds of spend left:

- S = step + write + checkpoint, the stop's own time: the trainer sees the stop file after finishing its
  current `step`, waits for a background `write` still in flight (asynchronous saves), then writes its
  final `checkpoint` (the last save's whole time). 0 for what has not been measured yet.
- A = max(margin, S): the allowance for jitter, at least `margin` and at least the stop's own time (a
  checkpoint measured once may run much longer the next time; a margin of 0 s must not make the stop
  cross the cap).
- H = max(poll, S) + poll + A, the horizon: the graceful stop is asked at the first poll with R <= H.
  Polls are `poll` apart, so one lands with R in (H - poll, H], i.e. R > S + A: a whole poll beyond the
  stop's cost plus allowance, whatever poll, margin, step and checkpoint times are.

Rules:

- graceful stop when R <= H, except while a trainer holds the run dir but is still starting
  (`trainer_starting`: no training heartbeat in this session yet): it would take the request at its first
  stop check, before step 1, and end with nothing saved. The request waits, and the watcher looks every
  `LOOK_SECONDS` (app/budget/watcher.py) for the first training heartbeat, then asks at once. So a
  stop asked late (the first poll of a run whose cap is smaller than one poll, or a horizon that grew)
  is still graceful whenever the rest pays for the step in progress and a checkpoint;
- immediate stop when spent >= cap; or when not even the stop's own time fits (R <= S, measured figures
  only: nothing measured, no such stop); or, with a graceful stop under way that has run past its
  expected time (S + A) while the cap is less than one poll away (a trainer that does not stop);
- alert when spent >= alert_fraction*cap or spent >= alert_usd (when set).

`look_again_seconds` tells the watcher when to look again: one poll, or sooner when a graceful stop
under way becomes overdue within the poll.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.budget.config import BudgetConfig
from app.budget.ledger import Ledger

STATES = ("ok", "alert", "stopping", "exhausted")
MIN_LOOK_SECONDS = 0.01  # the soonest the watcher is asked to look again (clock resolution, no busy loop)


@dataclass(frozen=True)
class PolicyInput:
    spent_usd: float
    cap_usd: float
    rate_usd_per_hour: float
    step_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    checkpoint_write_seconds: float = 0.0  # background part of the last save (already in checkpoint_seconds)
    poll_seconds: float = 10.0
    margin_seconds: float = 60.0
    alert_fraction: float = 0.8
    alert_usd: float = 0.0
    decay_fraction: float = 0.15
    stopping: str = ""  # the stop already asked for: "" | graceful | immediate
    stopping_seconds: float = 0.0  # how long ago that stop was asked
    trainer_starting: bool = False  # a trainer holds the run dir but has not reported training yet


@dataclass(frozen=True)
class Decision:
    state: str  # ok | alert | stopping | exhausted
    stop: str  # a new stop to ask for now: "" | graceful | immediate
    reason: str  # one line for logs, the stop file and Events
    alert: bool  # the alert threshold is crossed
    remaining_usd: float
    projected_total_usd: float  # spend projected at the next safe stopping point
    horizon_seconds: float  # H
    seconds_to_cap: float | None  # at the current rate; None when the rate is 0
    seconds_to_stop: float | None  # until the graceful stop fires; None when the rate is 0
    decay_seconds: float | None  # length of the budget-driven LR decay (decay_fraction of what the cap buys)
    decay: bool  # the trainer should be decaying its LR now
    waiting_for_trainer: bool = False  # a graceful stop is due but waits for the trainer's first step
    look_again_seconds: float = 0.0  # when the watcher should look again (<= poll)


def stop_seconds(inp: PolicyInput) -> float:
    """S: the stop's own time: the step in progress, a background write still in flight (asynchronous
    saves; 0 for synchronous ones) and the final checkpoint (blocking + background: a stop waits for all
    of it)."""
    return inp.step_seconds + inp.checkpoint_write_seconds + inp.checkpoint_seconds


def allowance_seconds(inp: PolicyInput) -> float:
    """A = max(margin, S): jitter allowance, at least the margin and at least the stop's own time."""
    return max(inp.margin_seconds, stop_seconds(inp))


def horizon_seconds(inp: PolicyInput) -> float:
    """H = max(poll, S) + poll + A: a poll lands with R in (H - poll, H], so R > S + A at the graceful
    request."""
    return max(inp.poll_seconds, stop_seconds(inp)) + inp.poll_seconds + allowance_seconds(inp)


def trainer_figures(led: Ledger, status: Any) -> tuple[float, float, float]:
    """(step, checkpoint, write) seconds: the trainer's latest (status.json), else the ledger's last known."""
    if not status:
        return led.step_seconds, led.checkpoint_seconds, led.checkpoint_write_seconds
    return (
        status.step_seconds or led.step_seconds,
        status.checkpoint_seconds or led.checkpoint_seconds,
        status.checkpoint_write_seconds or led.checkpoint_write_seconds,
    )


def policy_input(
    cfg: BudgetConfig, led: Ledger, spent: float, rate: float, status: Any, now: float, starting: bool = False
) -> PolicyInput:
    """What the policy decides on: spend and rate, the trainer's figures, the config and a stop under way."""
    step, ckpt, write = trainer_figures(led, status)
    return PolicyInput(
        spent_usd=spent,
        cap_usd=cfg.cap_usd,
        rate_usd_per_hour=rate,
        step_seconds=step,
        checkpoint_seconds=ckpt,
        checkpoint_write_seconds=write,
        poll_seconds=cfg.poll_seconds,
        margin_seconds=cfg.margin_seconds,
        alert_fraction=cfg.alert_fraction,
        alert_usd=cfg.alert_usd,
        decay_fraction=cfg.decay_fraction,
        stopping=led.stop.mode if led.stop else "",
        stopping_seconds=max(0.0, now - led.stop.unix) if led.stop else 0.0,
        trainer_starting=starting,
    )


def decide(inp: PolicyInput) -> Decision:
    cap, spent = inp.cap_usd, inp.spent_usd
    r = max(inp.rate_usd_per_hour, 0.0) / 3600.0
    h = horizon_seconds(inp)
    s = stop_seconds(inp)
    projected = spent + r * h
    remaining = cap - spent
    to_cap = max(remaining, 0.0) / r if r > 0 else None
    to_stop = max(cap - projected, 0.0) / r if r > 0 else None
    decay_len = inp.decay_fraction * cap / r if r > 0 else None
    decay = to_stop is not None and decay_len is not None and to_stop <= decay_len
    alert = spent >= inp.alert_fraction * cap or (inp.alert_usd > 0 and spent >= inp.alert_usd)
    poll = inp.poll_seconds
    look = poll
    waiting = False

    stop, reason = "", ""
    if inp.stopping != "immediate":
        expected = s + allowance_seconds(inp)  # a graceful stop should be over by then
        if spent >= cap:
            stop, reason = "immediate", f"cap reached: ${spent:.4f} spent of the ${cap:.4f} cap"
        elif inp.stopping == "graceful":
            overdue_in = expected - inp.stopping_seconds
            if overdue_in < MIN_LOOK_SECONDS:
                overdue_in = 0.0
            if overdue_in <= 0 and spent + r * poll >= cap:
                stop = "immediate"
                reason = (
                    f"the ${cap:.4f} cap would be crossed before the next poll (${spent:.4f} spent) and "
                    f"the graceful stop asked {inp.stopping_seconds:.0f} s ago has not ended "
                    f"(expected {expected:.0f} s)"
                )
            elif overdue_in > 0:
                look = min(poll, overdue_in)
        elif s > 0 and spent + r * s >= cap:
            stop = "immediate"
            reason = (
                f"no room for a graceful stop: ${remaining:.4f} left of the ${cap:.4f} cap, "
                f"a step and a checkpoint cost ${r * s:.4f}"
            )
        elif projected >= cap and inp.trainer_starting:
            waiting = True  # asked now, the trainer would stop before step 1 with nothing saved
        elif projected >= cap:
            stop = "graceful"
            reason = (
                f"${spent:.4f} spent of the ${cap:.4f} cap; the next safe stop (step + checkpoint "
                f"+ poll + allowance, {h:.0f} s at ${inp.rate_usd_per_hour:.2f}/h) would reach ${projected:.4f}"
            )

    asked = stop or inp.stopping
    if asked == "immediate" or spent >= cap:
        state = "exhausted"
    elif asked == "graceful":
        state = "stopping"
    elif alert:
        state = "alert"
    else:
        state = "ok"
    return Decision(
        state=state,
        stop=stop,
        reason=reason,
        alert=alert,
        remaining_usd=remaining,
        projected_total_usd=projected,
        horizon_seconds=h,
        seconds_to_cap=to_cap,
        seconds_to_stop=to_stop,
        decay_seconds=decay_len,
        decay=decay,
        waiting_for_trainer=waiting,
        look_again_seconds=look,
    )
