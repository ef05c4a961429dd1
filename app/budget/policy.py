"""The budget policy: given what is spent and how fast, when to alert, stop gracefully, or stop at once.

Pure arithmetic, no I/O, so the same rules run in the watcher, the dry run and the simulated-clock tests.
The terms (S, A, H below) and why each is there: docs/budget.md, "Policy".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.budget.ledger import Ledger
from app.config.budget import BudgetConfig

STATES = ("ok", "alert", "stopping", "exhausted")
MIN_LOOK_SECONDS = 0.01  # the soonest the watcher is asked to look again (clock resolution, no busy loop)
FROM_CONFIG = ("cap_usd", "poll_seconds", "margin_seconds", "alert_fraction", "alert_usd", "decay_fraction")
TRAINER_FIGURES = ("step_seconds", "checkpoint_seconds", "checkpoint_write_seconds")  # status.json, ledger


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
    """S: the step in progress, a background write still in flight, then the whole final checkpoint."""
    return inp.step_seconds + inp.checkpoint_write_seconds + inp.checkpoint_seconds


def allowance_seconds(inp: PolicyInput) -> float:
    """A = max(margin, S): the jitter allowance."""
    return max(inp.margin_seconds, stop_seconds(inp))


def horizon_seconds(inp: PolicyInput) -> float:
    """H = max(poll, S) + poll + A: a poll lands with R in (H - poll, H], so R > S + A when asked."""
    return max(inp.poll_seconds, stop_seconds(inp)) + inp.poll_seconds + allowance_seconds(inp)


def policy_input(
    cfg: BudgetConfig, led: Ledger, spent: float, rate: float, status: Any, now: float, starting: bool = False
) -> PolicyInput:
    """What the policy decides on: spend and rate, the config, a stop under way and the trainer's figures:
    its latest (status.json), else the ledger's last known (a final, synchronous save reports write 0)."""
    return PolicyInput(
        **{key: getattr(cfg, key) for key in FROM_CONFIG},
        **{key: getattr(status, key, 0.0) or getattr(led, key) for key in TRAINER_FIGURES},
        spent_usd=spent,
        rate_usd_per_hour=rate,
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
    look = poll = inp.poll_seconds  # look again after a poll, unless a graceful stop is overdue sooner
    stop, reason, waiting = "", "", False
    if inp.stopping != "immediate":
        expected = s + allowance_seconds(inp)  # a graceful stop should be over by then
        if spent >= cap:
            stop, reason = "immediate", f"cap reached: ${spent:.4f} spent of the ${cap:.4f} cap"
        elif inp.stopping == "graceful":
            overdue_in = expected - inp.stopping_seconds
            if overdue_in >= MIN_LOOK_SECONDS:
                look = min(poll, overdue_in)
            elif spent + r * poll >= cap:
                stop = "immediate"
                reason = (
                    f"the ${cap:.4f} cap would be crossed before the next poll (${spent:.4f} spent) and "
                    f"the graceful stop asked {inp.stopping_seconds:.0f} s ago has not ended "
                    f"(expected {expected:.0f} s)"
                )
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
