"""Where a run ends: max_steps, max_tokens and max_hours (PlannedEnd), and the plans agreed on the way that
move its end (DecayPlan: the budget's LR decay, max_hours' last step). max_hours' end is planned from the
measured pace and agreed by the ranks (app/trainer/stopping/agreement.py's StopAgreement); the LR curve that ends
there is app/trainer/optimization/schedule.py's Schedule. docs/training.md: "Planned ends and the LR schedule".

Every planned end anneals: the schedule's horizon is the step the run ends at. max_steps and max_tokens
give that step from the start (`horizon`). A clock does not: with a budget cap (WSD) or train.max_hours
the end is planned from the measured pace, agreed across ranks and stored in the trainer state as a
DecayPlan (exact resume). With WSD the plan is made when the steps left are `decay_fraction` of the run
and the decay starts there; with cosine (max_hours) it is made once the pace is measured and sets the
curve's end.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from app.config import Config
from app.trainer.stopping.causes import StopCause, StopDecision

PACE_STEPS = 10  # max_hours: steps a process measures its pace over before a plan
PACE_SHARE = 0.05  # cosine + max_hours: and this share of max_hours (a pace past compile and warm-up)
# max_hours after a plan: the clock still stops the run this share of max_hours (at least OVERRUN_SECONDS)
# past it, should the pace fall after the plan (a throttled or slower node, costlier late evaluations)
CLOCK_OVERRUN = 0.05
OVERRUN_SECONDS = 60.0
CLOCK_MARGIN = 0.02  # max_hours: the plan ends this share of the time left before the clock does


@dataclass(frozen=True)
class DecayPlan:
    """The agreed end plan: from `start_step` on the LR decays to min_lr over `steps` steps. Agreed by the
    ranks (StopAgreement), completed with the LR it starts from (Schedule.follow), stored in every
    checkpoint's trainer state as a JSON object (`to_dict`, `from_dict`)."""

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

    def to_dict(self) -> dict:
        """The trainer state's form (trainer_state.json): the fields that are set."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, saved: dict | None) -> DecayPlan | None:
        """A plan from a trainer state, older ones included (no cause: the budget's; no start_lr, no hours)."""
        return cls(**saved) if saved else None


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


@dataclass
class PlannedEnd:
    """max_steps, max_tokens and max_hours. The first two give the end step at once (`end_step`, the LR
    schedule's horizon); max_hours is a clock, so its end step is planned from the pace (`clock_proposal`),
    agreed by the ranks and followed from then on (`follow`; the trainer state stores it). From then on that step is the end: a run
    cut off by the clock would end short of min_lr. The clock stays a backstop (`overrun_seconds`) should
    the pace fall after the plan. Before a plan (too few steps to measure) the clock ends the run. A plan
    made for another max_hours than the resumed run's is dropped and made again (`plan_outdated`)."""

    max_steps: int
    max_tokens: int = 0
    max_seconds: float = 0.0  # over all restarts of the run
    tokens_per_step: int = 0
    schedule: str = "cosine"  # schedule.name and schedule.decay_fraction: how the clock's end is planned
    decay_fraction: float = 0.2
    plan: DecayPlan | None = None  # the agreed plan (budget or max_hours), once there is one
    pace_from: tuple[int, float] | None = None  # (step, elapsed) this process measures its pace from
    first_step: int | None = None

    @classmethod
    def of(cls, cfg: Config, tokens_per_step: int, plan: DecayPlan | None) -> PlannedEnd:
        """A run's planned end; `plan`: one agreed before a restart (see plan_outdated)."""
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

    def ends_at(self, step: int, tokens: int) -> bool:
        """Whether max_steps or max_tokens end the run at this step (known ahead on every rank alike, so
        its last eval can come before the save of the stop; the clock's limit is only known when agreed)."""
        return self.check(step, tokens, 0.0) is not None

    def follow(self, plan: DecayPlan | None) -> str:
        """An agreed plan (from the agreement, via Schedule.follow, or from a checkpoint): no more proposals,
        and a max_hours plan's last step is the planned end. Returns its line for the log."""
        self.plan = plan
        return plan_line(plan, self.schedule) if plan else ""

    def plan_outdated(self) -> bool:
        """Whether a resumed max_hours plan was made for another train.max_hours than this run's (more hours
        bought, or the clock turned off): it no longer says where the run ends, and is dropped
        (Schedule.drop_outdated) so the end is planned again from this run's pace (or comes from
        max_steps/max_tokens). A plan from an older pretrain did not record its hours: it stands unless the
        clock is off."""
        plan = self.plan
        hours = self.max_seconds / 3600
        if plan is None or plan.cause != "max_hours":
            return False
        if plan.hours is None:
            return not hours
        return not math.isclose(plan.hours, hours)

    def overrun_seconds(self) -> float:
        """How far past max_hours the clock lets a planned run go before it stops it all the same."""
        return max(CLOCK_OVERRUN * self.max_seconds, OVERRUN_SECONDS)

    def clock_proposal(self, step: int, tokens: int, elapsed: float) -> int:
        """Steps from `step` to the end of a max_hours plan, once this process has measured its pace from its
        second step on (compile and the first evaluation are behind it); 0 while there is nothing to plan."""
        if not self.max_seconds or self.plan is not None:
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
        plan = self.plan
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
        if self.plan is not None and self.plan.cause == "max_hours":
            end = min(end, self.plan.end_step)
        left = [(end - step) * step_seconds]
        if self.max_tokens and tokens_per_second > 0:
            left.append((self.max_tokens - tokens) / tokens_per_second)
        if self.max_seconds:
            left.append(self.max_seconds - elapsed)
        return max(0.0, min(left))
