"""The learning rate and Muon's momentum of every step: cosine, warmup-stable-decay (WSD) or constant,
to where the run ends (app/trainer/stopping/planned_end.py: the horizon of max_steps/max_tokens, and an agreed
DecayPlan once a budget cap or train.max_hours plans the end from the measured pace). `Schedule` is what
the training loop asks; the functions below are its arithmetic, which `pretrain bench` and the benchmarks
call directly. A plan's curve starts from the LR the run is at (stored with it), so it never jumps, and
its last step runs at min_lr exactly. docs/training.md ("Planned ends and the LR schedule") says what
each combination does.
"""

from __future__ import annotations

import math
from dataclasses import replace

from app.config import OptimConfig, ScheduleConfig
from app.trainer.stopping.planned_end import DecayPlan, PlannedEnd


class Schedule:
    """What the loop asks before each step: the LR and Muon's momentum of the step that turns `step` (with
    `tokens` trained) into `step + 1`, on the configured curve (schedule.*, optim.lr, optim.min_lr) to
    where the run ends (`end`: its horizon and the agreed plan, which moves that end)."""

    def __init__(self, sched: ScheduleConfig, optim: OptimConfig, end: PlannedEnd) -> None:
        self.sched = sched
        self.optim = optim
        self.end = end

    def lr(self, step: int, tokens: int) -> float:
        return lr_at(step, self.sched, self.optim, self.end.end_step(step, tokens), self.end.plan)

    def muon_momentum(self, step: int, tokens: int) -> float:
        """Its warm-up, then it follows how far the LR has decayed (muon_momentum_at)."""
        horizon = self.end.end_step(step, tokens)
        annealed = annealed_at(step, self.sched, self.optim, horizon, self.end.plan)
        return muon_momentum_at(step, annealed, self.optim)

    def follow(self, agreed: DecayPlan, step: int, tokens: int) -> str:
        """An end plan the ranks agreed at `step` (the budget's LR decay, or where max_hours ends): its curve
        starts at the LR this step runs at without it, so the LR does not jump, and the plan keeps that LR,
        so a resume follows the same curve. The planned end follows it too. Returns the line for the log."""
        return self.end.follow(replace(agreed, start_lr=self.lr(step, tokens)))

    def drop_outdated(self, step: int, tokens: int) -> str:
        """At a resume: drop a max_hours plan made for another train.max_hours (PlannedEnd.plan_outdated).
        Returns the line for the log, with the LR change it makes ("" when the plan stands)."""
        plan = self.end.plan
        if not self.end.plan_outdated():
            return ""
        before = self.lr(step, tokens)
        self.end.follow(None)
        after = self.lr(step, tokens)
        hours = self.end.max_seconds / 3600
        was = f"{plan.hours:g}" if plan.hours is not None else "another value"
        then = "its end is planned again from this run's pace" if hours else "max_steps/max_tokens end it"
        return (
            f"note: train.max_hours {was} -> {hours:g}: the LR schedule's planned end at step {plan.end_step} "
            f"is dropped and {then}; the LR at step {step} goes from {before:.3g} to {after:.3g} "
            "(docs/training.md: Planned ends and the LR schedule)"
        )


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
        "resume from a checkpoint taken before its decay (docs/training.md: Extending a run)"
    )
