"""Where a run ends: max_steps, max_tokens and max_hours (PlannedEnd), and the LR schedule that ends
there. max_hours' end is planned from the measured pace and agreed by the ranks (app/trainer/stopping.py's
StopAgreement); the schedule's arithmetic is app/trainer/schedule.py. README: "Planned ends and the LR
schedule".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.config import Config, OptimConfig, ScheduleConfig
from app.trainer.schedule import DecayPlan, annealed_at, clock_end_steps, horizon, lr_at, plan_line
from app.trainer.stop_causes import StopCause, StopDecision

PACE_STEPS = 10  # max_hours: steps a process measures its pace over before a plan
PACE_SHARE = 0.05  # cosine + max_hours: and this share of max_hours (a pace past compile and warm-up)
# max_hours after a plan: the clock still stops the run this share of max_hours (at least OVERRUN_SECONDS)
# past it, should the pace fall after the plan (a throttled or slower node, costlier late evaluations)
CLOCK_OVERRUN = 0.05
OVERRUN_SECONDS = 60.0


@dataclass
class PlannedEnd:
    """max_steps, max_tokens and max_hours. The first two give the end step at once (`end_step`, the LR
    schedule's horizon); max_hours is a clock, so its end step is planned from the pace (`clock_proposal`),
    agreed by the ranks and stored in the trainer state (`follow`). From then on that step is the end: a run
    cut off by the clock would end short of min_lr. The clock stays a backstop (`overrun_seconds`) should
    the pace fall after the plan. Before a plan (too few steps to measure) the clock ends the run. A plan
    made for another max_hours than the resumed run's is dropped and made again (`drop_outdated`)."""

    max_steps: int
    max_tokens: int = 0
    max_seconds: float = 0.0  # over all restarts of the run
    tokens_per_step: int = 0
    schedule: str = "cosine"  # schedule.name and schedule.decay_fraction: how the clock's end is planned
    decay_fraction: float = 0.2
    planned: DecayPlan | None = None  # the agreed plan (budget or max_hours), once there is one
    pace_from: tuple[int, float] | None = None  # (step, elapsed) this process measures its pace from
    first_step: int | None = None

    @classmethod
    def of(cls, cfg: Config, tokens_per_step: int, plan: dict | None) -> PlannedEnd:
        """A run's planned end; `plan`: one agreed before a restart (see drop_outdated)."""
        train = cfg.train
        schedule = cfg.schedule
        end = cls(
            train.max_steps,
            train.max_tokens,
            train.max_hours * 3600,
            tokens_per_step,
            schedule.name,
            schedule.decay_fraction,
        )
        end.follow(plan)
        return end

    def end_step(self, step: int, tokens: int) -> int:
        """The step the run ends at by max_steps or max_tokens: the LR schedule's horizon."""
        return horizon(self.max_steps, self.max_tokens, step, tokens, self.tokens_per_step)

    def follow(self, plan: dict | None) -> str:
        """An agreed plan (DecayPlan fields, from the agreement or a checkpoint): no more proposals, and a
        max_hours plan's last step is the planned end. Returns its line for the log."""
        self.planned = DecayPlan(**plan) if plan else None
        return plan_line(self.planned, self.schedule) if self.planned else ""

    def lr(self, step: int, tokens: int, sched: ScheduleConfig, optim: OptimConfig) -> float:
        """The LR of the step after `step`, on the schedule that ends at this planned end."""
        return lr_at(step, sched, optim, self.end_step(step, tokens), self.planned)

    def annealed(self, step: int, tokens: int, sched: ScheduleConfig, optim: OptimConfig) -> float:
        """How far that LR has decayed (0 at its top, 1 at min_lr): what Muon's momentum follows."""
        return annealed_at(step, sched, optim, self.end_step(step, tokens), self.planned)

    def drop_outdated(self, step: int, tokens: int, sched: ScheduleConfig, optim: OptimConfig) -> str:
        """A resumed max_hours plan made for another train.max_hours than this run's (more hours bought, or
        the clock turned off) no longer says where the run ends: drop it, so the end is planned again from
        this run's pace (or comes from max_steps/max_tokens). Returns the line for the log ("" when the plan
        stands). A plan from an older pretrain did not record its hours: it stands unless the clock is off."""
        plan = self.planned
        hours = self.max_seconds / 3600
        if plan is None or plan.cause != "max_hours":
            return ""
        if plan.hours is None and hours:
            return ""
        if plan.hours is not None and math.isclose(plan.hours, hours):
            return ""
        before = self.lr(step, tokens, sched, optim)
        self.planned = None
        after = self.lr(step, tokens, sched, optim)
        was = f"{plan.hours:g}" if plan.hours is not None else "another value"
        then = "its end is planned again from this run's pace" if hours else "max_steps/max_tokens end it"
        return (
            f"note: train.max_hours {was} -> {hours:g}: the LR schedule's planned end at step {plan.end_step} "
            f"is dropped and {then}; the LR at step {step} goes from {before:.3g} to {after:.3g} (README: "
            "Planned ends and the LR schedule)"
        )

    def overrun_seconds(self) -> float:
        """How far past max_hours the clock lets a planned run go before it stops it all the same."""
        return max(CLOCK_OVERRUN * self.max_seconds, OVERRUN_SECONDS)

    def clock_proposal(self, step: int, tokens: int, elapsed: float) -> int:
        """Steps from `step` to the end of a max_hours plan, once this process has measured its pace from its
        second step on (compile and the first evaluation are behind it); 0 while there is nothing to plan."""
        if not self.max_seconds or self.planned is not None:
            return 0
        if self.first_step is None:
            self.first_step = step
        if self.pace_from is None:
            self.pace_from = (step, elapsed) if step > self.first_step else None
            return 0
        first_step, first_elapsed = self.pace_from
        done = step - first_step
        since = elapsed - first_elapsed
        if done < PACE_STEPS or (self.schedule == "cosine" and elapsed < PACE_SHARE * self.max_seconds):
            return 0
        left = self.end_step(step, tokens) - step
        return clock_end_steps(
            step, self.max_seconds - elapsed, since / done, self.schedule, self.decay_fraction, left
        )

    def check(self, step: int, tokens: int, elapsed_seconds: float) -> StopDecision | None:
        if step >= self.max_steps:
            return StopDecision(StopCause.PLANNED, f"planned end: reached max_steps={self.max_steps}")
        if self.max_tokens and tokens >= self.max_tokens:
            return StopDecision(StopCause.PLANNED, f"planned end: reached max_tokens={self.max_tokens}")
        hours = self.max_seconds / 3600
        plan = self.planned
        if plan is not None and plan.cause == "max_hours":  # the plan's step ends it, annealed
            planned_for = f"max_hours={plan.hours:g}" if plan.hours is not None else "max_hours"
            if step >= plan.end_step:
                why = f"reached step {plan.end_step}, where the LR schedule planned for {planned_for} ends"
                return StopDecision(StopCause.PLANNED, f"planned end: {why}")
            if not self.max_seconds or elapsed_seconds < self.max_seconds + self.overrun_seconds():
                return None
            why = (
                f"max_hours={hours:g} overran by {(elapsed_seconds - self.max_seconds) / 60:.1f} min before "
                f"step {plan.end_step}, where the LR schedule ends (the pace fell after the plan); stopping "
                "above min_lr"
            )
            return StopDecision(StopCause.PLANNED, f"planned end: {why}")
        if self.max_seconds and elapsed_seconds >= self.max_seconds:
            return StopDecision(StopCause.PLANNED, f"planned end: reached max_hours={hours:g}")
        return None

    def seconds_left(
        self, step: int, tokens: int, elapsed: float, step_seconds: float, tokens_per_second: float
    ) -> float:
        """Time to the planned end at the current pace (whichever limit comes first)."""
        end = self.end_step(step, tokens)
        if self.planned is not None and self.planned.cause == "max_hours":
            end = min(end, self.planned.end_step)
        left = [(end - step) * step_seconds]
        if self.max_tokens and tokens_per_second > 0:
            left.append((self.max_tokens - tokens) / tokens_per_second)
        if self.max_seconds:
            left.append(self.max_seconds - elapsed)
        return max(0.0, min(left))
