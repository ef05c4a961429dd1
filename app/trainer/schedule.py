"""Learning-rate schedules: cosine, warmup-stable-decay (WSD), constant; and where they end.

Every planned end anneals: the schedule's horizon is the step the run ends at. max_steps and max_tokens
give that step from the start (`horizon`). A clock does not: with a budget cap (WSD) or train.max_hours
the end is planned from the measured pace, agreed across ranks and stored in the trainer state as a
DecayPlan (exact resume). With WSD the plan is made when the steps left are `decay_fraction` of the run
and the decay starts there; with cosine (max_hours) it is made once the pace is measured and sets the
curve's end. A plan's curve starts from the LR the run is at (stored with it), so it never jumps, and
its last step runs at min_lr exactly. README ("Planned ends and the LR schedule") says what each
combination does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.config import OptimConfig, ScheduleConfig

CLOCK_MARGIN = 0.02  # max_hours: the plan ends this share of the time left before the clock does


@dataclass
class DecayPlan:
    start_step: int  # the step it was agreed at
    steps: int  # WSD: linear decay to min_lr over this many steps, then min_lr; cosine: its end, from start
    cause: str = "budget"  # budget | max_hours (which ends the run at the plan's end)
    # The LR step `start_step` would have run at without the plan: the planned curve starts there, so a plan
    # agreed inside the warm-up (or a WSD decay) does not jump. None: a plan stored by an older pretrain,
    # which keeps its own curve (a warm-up capped at half the plan, a cosine from there) for exact resume.
    start_lr: float | None = None
    hours: float | None = None  # max_hours: the train.max_hours it was planned for (None: not recorded)

    @property
    def end_step(self) -> int:
        return self.start_step + self.steps


def horizon(max_steps: int, max_tokens: int, step: int, tokens: int, tokens_per_step: int) -> int:
    """The step the run ends at by max_steps or max_tokens (whichever first): from `step`, with `tokens`
    done, at `tokens_per_step`, max_tokens is reached after ceil(tokens left / tokens per step) steps."""
    if not max_tokens or tokens_per_step <= 0:
        return max_steps
    return min(max_steps, step + max(0, -(-(max_tokens - tokens) // tokens_per_step)))


def clock_end_steps(
    step: int, seconds_left: float, pace: float, name: str, decay_fraction: float, steps_by_count: int
) -> int:
    """max_hours: the steps from `step` to the plan's end, to agree now, or 0 to wait. The plan ends where
    the clock's time left (less CLOCK_MARGIN of it) runs out at `pace` seconds a step, unless max_steps or
    max_tokens (`steps_by_count` away) comes first. cosine: at once, as its end shapes the whole curve;
    wsd: when those steps are `decay_fraction` of the run (the budget's rule), its decay starting now;
    constant: never (nothing anneals)."""
    if pace <= 0 or seconds_left <= 0:
        return 0
    usable = seconds_left * (1 - CLOCK_MARGIN)
    if usable / pace >= steps_by_count:
        return 0
    if name == "cosine":
        return max(1, int(usable / pace))
    if name == "wsd":
        return budget_decay_steps(step, usable, pace, 0.0, decay_fraction)
    return 0


def lr_at(
    step: int,
    sched: ScheduleConfig,
    optim: OptimConfig,
    max_steps: int,
    budget_decay: DecayPlan | None = None,
) -> float:
    """LR for the optimizer step that turns `step` into `step + 1`. `max_steps`: the horizon (`horizon`);
    `budget_decay`: an agreed plan (budget or max_hours), which replaces the horizon's end from its start
    step on (`planned_lr`). A max_steps/max_tokens horizon leaves the warm-up alone: extending such a run
    by --max-steps must not change the warm-up it already ran."""
    plan = budget_decay
    if plan is not None and plan.start_lr is None:
        return _older_plan_lr(step, sched, optim, plan)
    if plan is not None and step >= plan.start_step:
        return planned_lr(step, sched.name, optim.min_lr, plan)
    peak, floor = optim.lr, optim.min_lr
    warmup = sched.warmup_steps
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if sched.name == "constant":
        return peak
    if sched.name == "cosine":
        span = max(1, max_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
    # WSD: flat at peak, then a linear decay to min_lr
    steps = max(1, round(sched.decay_fraction * max_steps))
    if step < max_steps - steps:
        return peak
    return peak - (peak - floor) * min(1.0, (step - max_steps + steps + 1) / steps)


def planned_lr(step: int, name: str, floor: float, plan: DecayPlan) -> float:
    """The LR from a plan's start step on: from `plan.start_lr` (where the run was, so nothing jumps,
    inside the warm-up included) down to `floor`, which the plan's last step (end_step - 1, the one that
    makes the final weights) runs at exactly; cosine or linear (WSD), then `floor`. constant: start_lr."""
    top = plan.start_lr
    if name == "constant":
        return top
    done = step - plan.start_step
    if name == "cosine":
        progress = min(1.0, done / (plan.steps - 1)) if plan.steps > 1 else 1.0
        return floor + 0.5 * (top - floor) * (1 + math.cos(math.pi * progress))
    return floor + (top - floor) * max(0.0, 1 - (done + 1) / max(1, plan.steps))  # floor, exactly, at the end


def _older_plan_lr(step: int, sched: ScheduleConfig, optim: OptimConfig, plan: DecayPlan) -> float:
    """A plan stored without start_lr (pretrain before planned_lr): its warm-up takes at most half the
    planned run and the cosine runs from there to the plan's end; WSD is flat at peak, then decays."""
    peak, floor = optim.lr, optim.min_lr
    end = plan.end_step
    warmup = min(sched.warmup_steps, end // 2)
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if sched.name == "constant":
        return peak
    if sched.name == "cosine":
        progress = min(1.0, (step - warmup) / max(1, end - warmup))
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
    if step < plan.start_step:
        return peak
    return peak - (peak - floor) * min(1.0, (step - plan.start_step + 1) / max(1, plan.steps))


def annealed_at(
    step: int, sched: ScheduleConfig, optim: OptimConfig, max_steps: int, plan: DecayPlan | None = None
) -> float:
    """How far the LR has decayed at `step`: 0 while it warms up or holds its peak, 1 at min_lr. Under a
    plan the decay starts at the plan's start (from its start_lr, inside the warm-up too)."""
    top = optim.lr
    if plan is not None and plan.start_lr is not None and step >= plan.start_step:
        top = plan.start_lr
    elif step < sched.warmup_steps:
        return 0.0
    if top <= optim.min_lr:  # nothing left to decay: at the floor already, or no decay configured
        return 1.0 if optim.lr > optim.min_lr else 0.0
    lr = lr_at(step, sched, optim, max_steps, plan)
    return min(1.0, max(0.0, (top - lr) / (top - optim.min_lr)))


def muon_momentum_at(step: int, annealed: float, optim: OptimConfig) -> float:
    """Muon's momentum for the step that turns `step` into `step + 1`, the LR's decay `annealed` far
    (annealed_at): with muon_momentum_warmup_steps, a linear rise from muon_momentum_start to
    muon_momentum first (the record's 0.85 -> 0.95 over 300 steps); with muon_momentum_end, it follows the
    LR's decay from its top to min_lr down to muon_momentum_end (nanochat's 0.97 -> 0.90 over its
    warmdown; the record's last 50 steps back to 0.85), whatever moves that decay (schedule, budget,
    max_hours' plan); else constant."""
    momentum = optim.muon_momentum
    warmup = optim.muon_momentum_warmup_steps
    if warmup and step < warmup:
        frac = step / warmup
        return (1 - frac) * optim.muon_momentum_start + frac * momentum
    if optim.muon_momentum_end:
        return momentum + annealed * (optim.muon_momentum_end - momentum)
    return momentum


def budget_decay_steps(
    step: int, seconds_to_cap: float, step_seconds: float, reserve_seconds: float, decay_fraction: float
) -> int:
    """Steps of budget-driven decay to start now, or 0 to keep the LR flat. `seconds_to_cap`: the watcher's
    projection; `reserve_seconds`: the final checkpoint and margin. The remaining affordable steps are a
    fraction f of the run when remaining <= f/(1-f) * done."""
    if step <= 0 or step_seconds <= 0 or seconds_to_cap <= 0:
        return 0
    affordable = int(max(0.0, seconds_to_cap - reserve_seconds) / step_seconds)
    if affordable <= decay_fraction / (1 - decay_fraction) * step:
        return max(1, affordable)
    return 0


def plan_line(plan: DecayPlan, schedule: str) -> str:
    """The log line of a newly agreed plan."""
    if plan.cause == "budget":
        return f"budget: starting the LR decay now, {plan.steps} steps before the cap"
    what = "its decay starts now" if schedule == "wsd" else "the cosine ends there"
    return (
        f"max_hours: the LR schedule ends at step {plan.end_step} ({plan.steps} steps from now at the measured "
        f"pace, {CLOCK_MARGIN:.0%} of the time left to spare); {what}, and so does the run"
    )


def resume_change(old: tuple, new: tuple, step: int, budget_decay: DecayPlan | None) -> str | None:
    """A line for the log when a resumed run's schedule differs from the checkpoint's at the resumed step
    (e.g. a larger max_steps stretches the cosine and lifts the LR back up); None when the LR is unchanged.
    `old` and `new` are (ScheduleConfig, OptimConfig, max_steps)."""
    lr_old = lr_at(step, old[0], old[1], old[2], budget_decay)
    lr_new = lr_at(step, new[0], new[1], new[2], budget_decay)
    if math.isclose(lr_old, lr_new, rel_tol=1e-9, abs_tol=1e-12):
        return None
    what = f"max_steps {old[2]} -> {new[2]}" if old[2] != new[2] else "the schedule settings changed"
    return (
        f"note: {what}: the {new[0].name} schedule is recomputed; the LR at step {step} goes from "
        f"{lr_old:.3g} to {lr_new:.3g}. To extend a run without re-warming, train with schedule.name=wsd and "
        "resume from a checkpoint taken before its decay (README: Extending a run)"
    )
