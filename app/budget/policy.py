"""The budget policy: given what is spent and how fast, when to alert, stop gracefully, or stop at once.

Pure arithmetic, no I/O, so the same rules run in the watcher and in the simulated-clock tests.

The graceful point G = max(poll, step + write + checkpoint): the trainer sees the stop file after finishing
its current `step`, waits for a background `write` still in flight (asynchronous saves), then writes a
`checkpoint` (the last save's whole time), and the watcher cannot look again
sooner than `poll`; with less than G of spend left a graceful stop no longer fits. The horizon
H = G + poll + margin reaches one whole poll (plus `margin`, for jitter) beyond that point, so the graceful
window (H - G of spend) is never narrower than one poll and no poll can jump over it. (Before, H was
poll + step + checkpoint + margin: with step + checkpoint + margin < poll a poll could skip from "ok" to
"no room" and the run ended with an immediate stop and no checkpoint.) Rules, with r the rate in USD/s:

- graceful stop when spent + r*H >= cap (the spend projected at the next safe stopping point);
- immediate stop when spent >= cap, or when not even a graceful stop fits any more
  (spent + r*G >= cap), or, with a graceful stop under way, when the cap would be crossed before the
  next poll (spent + r*poll >= cap);
- alert when spent >= alert_fraction*cap or spent >= alert_usd (when set).
"""

from __future__ import annotations

from dataclasses import dataclass

STATES = ("ok", "alert", "stopping", "exhausted")
STATE_CODES = {s: i for i, s in enumerate(STATES)}


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


def graceful_point_seconds(inp: PolicyInput) -> float:
    """G: the least spend time a graceful stop needs: a step, a pending background write (asynchronous
    saves; 0 for synchronous ones), the final checkpoint (blocking + background: a stop waits for all of
    it), and one poll to notice."""
    return max(inp.poll_seconds, inp.step_seconds + inp.checkpoint_write_seconds + inp.checkpoint_seconds)


def horizon_seconds(inp: PolicyInput) -> float:
    """H = G + poll + margin: at least one poll beyond the graceful point, whatever the settings."""
    return graceful_point_seconds(inp) + inp.poll_seconds + inp.margin_seconds


def decide(inp: PolicyInput) -> Decision:
    cap, spent = inp.cap_usd, inp.spent_usd
    r = max(inp.rate_usd_per_hour, 0.0) / 3600.0
    h = horizon_seconds(inp)
    projected = spent + r * h
    remaining = cap - spent
    to_cap = max(remaining, 0.0) / r if r > 0 else None
    to_stop = max(cap - projected, 0.0) / r if r > 0 else None
    decay_len = inp.decay_fraction * cap / r if r > 0 else None
    decay = to_stop is not None and decay_len is not None and to_stop <= decay_len
    alert = spent >= inp.alert_fraction * cap or (inp.alert_usd > 0 and spent >= inp.alert_usd)

    stop, reason = "", ""
    if inp.stopping != "immediate":
        graceful_cost = r * graceful_point_seconds(inp)
        if spent >= cap:
            stop, reason = "immediate", f"cap reached: ${spent:.4f} spent of the ${cap:.4f} cap"
        elif inp.stopping == "graceful" and spent + r * inp.poll_seconds >= cap:
            stop = "immediate"
            reason = (
                f"the ${cap:.4f} cap would be crossed before the next poll "
                f"(${spent:.4f} spent) while the graceful stop is still running"
            )
        elif not inp.stopping and spent + graceful_cost >= cap:
            stop = "immediate"
            reason = (
                f"no room for a graceful stop: ${remaining:.4f} left of the ${cap:.4f} cap, "
                f"a step and a checkpoint cost ${graceful_cost:.4f}"
            )
        elif not inp.stopping and projected >= cap:
            stop = "graceful"
            reason = (
                f"${spent:.4f} spent of the ${cap:.4f} cap; the next safe stop (step + checkpoint "
                f"+ margin, {h:.0f} s at ${inp.rate_usd_per_hour:.2f}/h) would reach ${projected:.4f}"
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
    )
