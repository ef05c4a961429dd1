"""LR schedules, weight-decay groups, and the budget-driven WSD decay end to end."""

from __future__ import annotations

import math

import pytest
import torch

from app.config import OptimConfig, ScheduleConfig, load_config
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import param_groups
from app.trainer.optimization.schedule import Schedule, lr_at
from app.trainer.stopping.causes import StopCause
from app.trainer.stopping.planned_end import (
    CLOCK_MARGIN,
    CLOCK_OVERRUN,
    OVERRUN_SECONDS,
    PACE_SHARE,
    PACE_STEPS,
    DecayPlan,
    PlannedEnd,
    budget_decay_steps,
    clock_end_steps,
    horizon,
)
from tests.conftest import FAST, pretrain, train_rows

OPT = OptimConfig(lr=1.0, min_lr=0.1)


def test_warmup_then_cosine_to_min_lr():
    s = ScheduleConfig(name="cosine", warmup_steps=10)
    assert lr_at(0, s, OPT, 110) == pytest.approx(0.1)
    assert lr_at(9, s, OPT, 110) == pytest.approx(1.0)
    assert lr_at(60, s, OPT, 110) == pytest.approx(0.55)  # half way: (peak + floor) / 2
    assert lr_at(110, s, OPT, 110) == pytest.approx(0.1)
    lrs = [lr_at(i, s, OPT, 110) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    s = ScheduleConfig(name="wsd", warmup_steps=0, decay_fraction=0.2)
    assert [lr_at(i, s, OPT, 100) for i in (0, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_at(89, s, OPT, 100) == pytest.approx(0.55)
    assert lr_at(99, s, OPT, 100) == pytest.approx(0.1)
    # A budget-driven decay replaces the fixed one.
    plan = DecayPlan(start_step=30, steps=10)
    assert lr_at(29, s, OPT, 100, plan) == 1.0
    assert lr_at(39, s, OPT, 100, plan) == pytest.approx(0.1)
    assert lr_at(80, s, OPT, 100, plan) == pytest.approx(0.1)
    # decided during max_steps' own decay (LR 0.775 at step 84): it goes on down from there, not from peak
    late = DecayPlan(start_step=84, steps=10, start_lr=lr_at(84, s, OPT, 100))
    assert lr_at(84, s, OPT, 100, late) == pytest.approx(0.775 - 0.0675)
    assert lr_at(93, s, OPT, 100, late) == 0.1


def test_budget_decay_starts_when_the_remaining_budget_is_the_decay_fraction_of_the_run():
    # 100 steps done at 1 s/step; with f = 0.2 the decay should be the last 25 steps (20% of 125).
    assert (
        budget_decay_steps(100, seconds_to_cap=26, step_seconds=1, reserve_seconds=0, decay_fraction=0.2) == 0
    )
    assert (
        budget_decay_steps(100, seconds_to_cap=25, step_seconds=1, reserve_seconds=0, decay_fraction=0.2)
        == 25
    )
    assert (
        budget_decay_steps(100, seconds_to_cap=30, step_seconds=1, reserve_seconds=5, decay_fraction=0.2)
        == 25
    )
    assert budget_decay_steps(0, 10, 1, 0, 0.2) == 0  # nothing measured yet


@pytest.mark.parametrize("name", ["cosine", "wsd"])
def test_a_plan_agreed_inside_the_warmup_decays_from_where_the_lr_is(name):
    """tiny's 30 warm-up steps and a max_hours plan agreed at step 11 that ends at 25 (a slow machine): the
    planned curve starts at the LR step 11 runs at unplanned (12/30 of peak), so the LR never jumps (it
    used to jump to peak, 2.5x in one step), decays every step after and the plan's last step (24, which
    makes the final weights) runs at min_lr exactly."""
    s = ScheduleConfig(name=name, warmup_steps=30)
    start_lr = lr_at(11, s, OPT, 10**6)
    assert start_lr == pytest.approx(12 / 30)
    plan = DecayPlan(start_step=11, steps=14, cause="max_hours", start_lr=start_lr)
    lrs = [lr_at(i, s, OPT, 10**6, plan) for i in range(0, 30)]
    rises = [b - a for a, b in zip(lrs, lrs[1:], strict=False)]
    assert max(rises) <= 1 / 30 + 1e-12  # never more than one warm-up increment
    assert all(rise < 0 for rise in rises[11:24])  # annealing from the plan on
    assert lrs[24] == 0.1 and lrs[25:] == [0.1] * 5


@pytest.mark.parametrize(("start", "steps"), [(11, 3), (12, 98), (40, 1), (7, 2), (500, 12345)])
def test_a_planned_cosine_runs_its_last_step_at_min_lr(start, steps):
    """The step that makes a planned run's final weights (end_step - 1) runs at min_lr, not one step short
    of it (`--set train.max_hours=0.02` ends at min_lr)."""
    s = ScheduleConfig(name="cosine", warmup_steps=5)
    plan = DecayPlan(start_step=start, steps=steps, cause="max_hours", start_lr=0.9)
    assert lr_at(plan.end_step - 1, s, OPT, 10**6, plan) == 0.1
    assert lr_at(start, s, OPT, 10**6, plan) == pytest.approx(0.9 if steps > 1 else 0.1)


def test_a_plan_stored_by_an_older_pretrain_keeps_its_curve():
    """A plan without start_lr (a checkpoint from before it existed) follows the curve it was made on: the
    warm-up capped at half the plan, the cosine from there to the plan's end (exact resume)."""
    s = ScheduleConfig(name="cosine", warmup_steps=30)
    plan = DecayPlan(start_step=11, steps=14, cause="max_hours")
    assert lr_at(11, s, OPT, 400, plan) == pytest.approx(1.0)
    assert lr_at(25, s, OPT, 400, plan) == pytest.approx(0.1)
    assert lr_at(11, s, OPT, 16) == pytest.approx(12 / 30)  # max_steps alone: the warm-up is as configured


def test_the_horizon_is_the_first_of_max_steps_and_max_tokens():
    assert horizon(1000, 0, 0, 0, 512) == 1000
    assert horizon(1000, 512 * 20, 0, 0, 512) == 20  # 20 steps of 512 tokens
    assert horizon(1000, 512 * 20 + 1, 0, 0, 512) == 21  # the step that crosses it is the last
    assert horizon(1000, 512 * 20, 8, 8 * 512, 512) == 20  # the same end seen from a resumed step
    assert horizon(10, 512 * 20, 0, 0, 512) == 10


def test_a_cosine_plan_moves_the_end_of_the_curve():
    s = ScheduleConfig(name="cosine", warmup_steps=10)
    plan = DecayPlan(start_step=10, steps=101, cause="max_hours", start_lr=1.0)  # max_steps is 10^6
    assert [lr_at(i, s, OPT, 10**6, plan) for i in (60, 110)] == [pytest.approx(0.55), 0.1]


def test_the_clock_end_is_planned_from_the_pace():
    left = 1000.0  # seconds to max_hours at 1 s a step; CLOCK_MARGIN of them spare
    usable = int(left * (1 - CLOCK_MARGIN))
    assert clock_end_steps(50, left, 1.0, "cosine", 0.2, 10**6) == usable  # cosine: at once
    assert clock_end_steps(50, left, 1.0, "cosine", 0.2, usable) == 0  # max_steps/tokens come first
    assert clock_end_steps(50, left, 1.0, "wsd", 0.2, 10**6) == 0  # wsd: not yet (20% would be 12 steps)
    assert clock_end_steps(4000, left, 1.0, "wsd", 0.2, 10**6) == usable  # now: the rest is 20% of the run
    assert clock_end_steps(4000, left, 1.0, "constant", 0.2, 10**6) == 0
    assert clock_end_steps(4000, left, 0.0, "cosine", 0.2, 10**6) == 0  # no pace yet


def test_planned_end_measures_its_pace_then_ends_at_the_agreed_step():
    """A process proposes a max_hours plan only after PACE_STEPS steps past its first (compile, the first
    evaluation), and for cosine after PACE_SHARE of the hours; once a plan is agreed it proposes nothing
    more and the run ends at the plan's last step (or at the clock, whichever first)."""
    end = PlannedEnd(10**6, max_seconds=1000.0, tokens_per_step=512, schedule="cosine")
    assert end.clock_proposal(0, 0, 0.0) == 0  # the first step seen: compile ahead
    assert end.clock_proposal(1, 512, 10.0) == 0  # the pace is measured from here
    assert end.clock_proposal(1 + PACE_STEPS, 0, 20.0) == 0  # 10 steps, but 2% of the hours
    step, at = 1 + 4 * PACE_STEPS, PACE_SHARE * 1000  # 40 steps in 40 s: 1 s a step
    proposed = end.clock_proposal(step, 0, at)
    assert proposed == int((1000 - at) * (1 - CLOCK_MARGIN))
    end.follow(DecayPlan(step, proposed, "max_hours"))
    assert end.clock_proposal(step + 1, 0, at + 1) == 0
    assert end.check(step + proposed - 1, 0, 1050.0) is None  # the plan, not the clock, ends it now
    assert "reached step" in end.check(step + proposed, 0, 990.0).reason
    unplanned = PlannedEnd(10**6, max_seconds=1000.0)
    assert "max_hours=0.277778" in unplanned.check(5, 0, 1000.0).reason  # too few steps to plan: the clock
    budget = PlannedEnd(10**6, max_seconds=1000.0)
    budget.follow(DecayPlan.from_dict({"start_step": 5, "steps": 10}))  # no cause: an older checkpoint's
    assert budget.plan.cause == "budget" and budget.check(100, 0, 0.0) is None  # a budget decay ends nothing


def test_the_clock_still_stops_a_planned_run_whose_pace_fell():
    """After a max_hours plan the plan's step ends the run, but should the pace fall (a throttled or slower
    node) the clock stops it anyway CLOCK_OVERRUN of max_hours (at least OVERRUN_SECONDS) past it, saying
    so: a run bought for 10 hours stops by 10.5, not at twice the hours."""
    hours = PlannedEnd(10**6, max_seconds=36000.0)
    hours.follow(DecayPlan(100, 900, "max_hours", start_lr=1.0, hours=10.0))
    assert hours.check(500, 0, 36000.0 * (1 + CLOCK_OVERRUN) - 1) is None
    late = hours.check(500, 0, 36000.0 * (1 + CLOCK_OVERRUN))
    assert (
        late.cause == StopCause.PLANNED and "max_hours=10 overran by 30.0 min before step 1000" in late.reason
    )
    assert "planned for max_hours=10 ends" in hours.check(1000, 0, 100.0).reason
    short = PlannedEnd(10**6, max_seconds=72.0)  # 0.02 hours: a minute's slack, not 3.6 s
    short.follow(DecayPlan(11, 3, "max_hours", start_lr=1.0, hours=0.02))
    assert short.check(12, 0, 72.0 + OVERRUN_SECONDS - 1) is None
    assert short.check(12, 0, 72.0 + OVERRUN_SECONDS).stops


@pytest.mark.parametrize(
    ("resumed_hours", "stored_hours", "dropped"),
    [(0.04, 0.02, True), (0.0, 0.02, True), (0.02, 0.02, False), (0.04, None, False), (0.0, None, True)],
)
def test_a_plan_for_another_max_hours_is_dropped_on_resume(resumed_hours, stored_hours, dropped):
    """A finished (or interrupted) max_hours run resumed with more hours, or with none, plans its end again
    instead of stopping at the old plan's step; the same hours keep the plan (exact resume). A plan from
    an older pretrain (no hours recorded) stands unless the clock is off."""
    s = ScheduleConfig(name="cosine", warmup_steps=5)
    end = PlannedEnd(10**6, max_seconds=resumed_hours * 3600)
    stored = {"start_step": 11, "steps": 3, "cause": "max_hours", "start_lr": 1.0, "hours": stored_hours}
    end.follow(DecayPlan.from_dict(stored))
    line = Schedule(s, OPT, end).drop_outdated(14, 0)
    assert (end.plan is None) == dropped and bool(line) == dropped
    if dropped:
        assert f"max_hours {stored_hours or 'another value'} -> {resumed_hours:g}" in line, line
        assert "the LR at step 14 goes from 0.1 to 1" in line, line
        assert end.check(14, 0, 0.0) is None  # trains on
    else:
        assert end.check(14, 0, 0.0).stops
    budget = PlannedEnd(10**6, max_seconds=resumed_hours * 3600)
    budget.follow(DecayPlan(11, 3, "budget"))
    assert Schedule(s, OPT, budget).drop_outdated(14, 0) == "" and budget.plan is not None


def test_the_schedule_follows_an_agreed_plan_from_its_lr_and_a_resume_follows_the_same_curve():
    """The loop asks the Schedule for each step's LR and Muon momentum. A plan the ranks agree carries no
    LR: the schedule starts it at the LR that step had without it, and nothing before it moves. The plan as
    a checkpoint stores it (a JSON object) gives the resumed run the same LR and momentum at every step."""
    import json

    s = ScheduleConfig(name="wsd", warmup_steps=5, decay_fraction=0.2)
    opt = OptimConfig(lr=1.0, min_lr=0.1, muon_momentum=0.95, muon_momentum_end=0.85)
    live = Schedule(s, opt, PlannedEnd(1000))
    before = [live.lr(step, 0) for step in range(40)]
    line = live.follow(DecayPlan(20, 10, "budget"), 20, 0)
    assert line == "budget: starting the LR decay now, 10 steps before the cap"
    assert live.end.plan == DecayPlan(20, 10, "budget", start_lr=1.0)
    assert [live.lr(step, 0) for step in range(21)] == [*before[:20], pytest.approx(0.91)]
    assert live.lr(29, 0) == 0.1 and live.muon_momentum(29, 0) == pytest.approx(0.85)  # annealed
    assert live.muon_momentum(19, 0) == 0.95  # at the peak until the plan
    saved = json.loads(json.dumps(live.end.plan.to_dict()))
    assert saved == {"start_step": 20, "steps": 10, "cause": "budget", "start_lr": 1.0}
    resumed = Schedule(s, opt, PlannedEnd(1000, plan=DecayPlan.from_dict(saved)))
    curve = [(live.lr(step, 0), live.muon_momentum(step, 0)) for step in range(40)]
    assert [(resumed.lr(step, 0), resumed.muon_momentum(step, 0)) for step in range(40)] == curve


def test_no_weight_decay_on_norms_and_embeddings():
    from app.config import ModelConfig, OptimConfig

    model = build_model(ModelConfig(vocab_size=64, seq_len=8, n_layer=1, d_model=16, n_head=2))
    groups = param_groups(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = [p for g in groups if g["weight_decay"] == 0.0 for p in g["params"]]
    decay = [p for g in groups if g["weight_decay"] == 0.1 for p in g["params"]]
    assert {names[id(p)] for p in no_decay} == {
        "tok_emb.weight",
        "blocks.0.attn_norm.weight",
        "blocks.0.mlp_norm.weight",
        "norm.weight",
    }
    assert len(decay) + len(no_decay) == len(names)
    assert all(p.dim() == 2 for p in decay)


@pytest.mark.slow  # over 10 s: `make test-slow`, which CI runs too
def test_budget_drives_the_wsd_decay_and_ends_annealed_inside_the_cap(tmp_path):
    """A $0.02 cap at $3.60/GPU-hour (about 20 s of training): the watcher's projection starts the LR
    decay before the graceful stop, so the last checkpoint is annealed, and the spend stays under the cap."""
    run = tmp_path / "run"
    proc = pretrain(
        "train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "1000000",
        "--budget-cap-usd",
        "0.02",
        "--price-per-gpu-hour",
        "3.6",
        "--gpus",
        "1",
        "--set",
        "schedule.name=wsd",
        "--set",
        "schedule.warmup_steps=5",
        "--set",
        "budget.decay_fraction=0.3",
        "--set",
        "budget.poll_seconds=0.5",
        "--set",
        "budget.margin_seconds=1",
        "--set",
        "optim.lr=0.002",
        "--set",
        "optim.min_lr=0.0002",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "budget: starting the LR decay now" in proc.stdout
    rows = train_rows(run)
    lrs = [r["lr"] for r in rows]
    assert max(lrs) == pytest.approx(0.002)
    assert lrs[-1] < 0.002 * 0.6  # well into the decay when the budget stopped the run
    assert all(
        a >= b for a, b in zip(lrs[lrs.index(max(lrs)) + 1 :], lrs[lrs.index(max(lrs)) + 2 :], strict=False)
    )
    import json

    state = json.loads((run / "budget" / "state.json").read_text())
    assert state["spent_usd"] <= 0.02
    assert not math.isnan(rows[-1]["loss"])


# max_steps out of reach, so the clock ends the run; a short warm-up, LR 2e-3 down to 2e-4
CLOCK_BOUND = [
    *FAST,
    "--max-steps",
    "1000000",
    "--set",
    "schedule.warmup_steps=5",
    "--set",
    "optim.lr=0.002",
    "--set",
    "optim.min_lr=0.0002",
]


def _ends_annealed(run, min_lr: float, gap: float, tolerance: float) -> dict:
    """The last step's LR (metrics.jsonl) is the minimum, and the newest checkpoint holds that step."""
    import json

    from app.trainer.checkpoint.store import load_trainer_state, resolve_latest

    last = train_rows(run)[-1]
    info = resolve_latest(run)
    assert info.step == last["step"] and load_trainer_state(info)["lr"] == pytest.approx(last["lr"])
    assert min_lr - 1e-12 <= last["lr"] <= min_lr + tolerance * gap + 1e-12, (
        last,
        json.dumps(info.meta["config"]["schedule"]),
    )
    return last


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_max_tokens_run_ends_at_the_minimum_lr_on_a_checkpoint(tmp_path, schedule):
    """max_tokens, not max_steps, ends the run (20 steps of 8 x 64 tokens): the schedule's horizon is that
    step, so the last step runs at min_lr (WSD exactly; cosine's last step is within 1% of the gap)."""
    run = tmp_path / "run"
    lr = ["--set", "optim.lr=0.002", "--set", "optim.min_lr=0.0002", "--set", "schedule.warmup_steps=2"]
    proc = pretrain(
        "train",
        "--out",
        str(run),
        *FAST,
        *lr,
        "--max-steps",
        "100000",
        "--set",
        f"schedule.name={schedule}",
        "--set",
        f"train.max_tokens={8 * 64 * 20}",
    )
    assert proc.returncode == 0, proc.stderr
    last = _ends_annealed(run, 0.0002, 0.0018, 0.0 if schedule == "wsd" else 0.01)
    assert last["step"] == 20


MAX_HOURS = ["--set", "train.max_hours=0.004"]


def clocked_args(schedule: str) -> list[str]:
    """A clock-bound run of `schedule` that keeps a checkpoint every 20 steps."""
    keep = ["--set", "checkpoint.every_steps=20", "--set", "checkpoint.keep_last=100000"]
    return [*CLOCK_BOUND, "--set", f"schedule.name={schedule}", *keep]


@pytest.fixture(scope="module")
def clocked_runs(tmp_path_factory):
    """The max_hours=0.004 runs (14.4 s of training each), one per schedule, made on first use: the run
    that ends at its plan and resumes exactly, and (WSD, tiny's schedule) the finished run that is resumed
    with more hours. {schedule: (run dir, its process)}; a test that trains on copies it first."""
    made: dict = {}
    root = tmp_path_factory.mktemp("clocked")

    def get(schedule: str):
        if schedule not in made:
            run = root / schedule
            made[schedule] = run, pretrain("train", "--out", str(run), *clocked_args(schedule), *MAX_HOURS)
        return made[schedule]

    return get


@pytest.mark.slow  # 15 s of training, then the tail again
@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_max_hours_run_ends_annealed_on_a_checkpoint_and_resumes_exactly(tmp_path, schedule, clocked_runs):
    """max_hours=0.004 (14.4 s) with max_steps out of reach: the ranks agree on the step the clock ends at
    (cosine: once the pace is measured; WSD: when the rest is its decay fraction), the LR reaches min_lr
    there and the run ends on that step's checkpoint. The plan is in the trainer state: a copy of the run
    resumed from a checkpoint after the plan ends at the same step with bit-identical weights."""
    import re
    import shutil

    from app.trainer.checkpoint import store as ckpt

    args = clocked_args(schedule)
    run, proc = clocked_runs(schedule)
    assert proc.returncode == 0, proc.stderr
    planned = re.search(r"max_hours: the LR schedule ends at step (\d+) \((\d+) steps from now", proc.stdout)
    assert planned, proc.stdout[-3000:]
    end, start = int(planned[1]), int(planned[1]) - int(planned[2])
    assert f"planned end: reached step {end}" in proc.stdout
    last = _ends_annealed(run, 0.0002, 0.0018, 0.0)  # a plan's last step runs at min_lr exactly
    assert last["step"] == end
    after = [p for p in ckpt.list_checkpoints(run) if start < ckpt.step_of(p) < end]
    assert after, f"no checkpoint between the plan (step {start}) and the end ({end})"
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for p in ckpt.list_checkpoints(copy):
        if ckpt.step_of(p) > ckpt.step_of(after[-1]):
            shutil.rmtree(p)
    resumed = pretrain("train", "--out", str(copy), *args, *MAX_HOURS)
    assert resumed.returncode == 0, resumed.stderr
    assert f"planned end: reached step {end}" in resumed.stdout
    want, got = (ckpt.load_model_state(ckpt.resolve_latest(r)) for r in (run, copy))
    assert ckpt.resolve_latest(copy).step == end
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow  # 0.03 hours (108 s) of training, as a user runs it
def test_the_tiny_preset_for_0_03_hours_ends_at_min_lr_on_a_checkpoint_without_an_lr_jump(tmp_path):
    """The command a user runs: `pretrain train --set train.max_hours=0.03`: the plan comes after the 10
    steps a run measures its pace over, inside the tiny preset's 60-step warm-up. 0.03 hours leave room
    for those steps even at 7 s a step on a loaded 2-core box (0.02 hours once ended by the clock at step
    11, before a plan). The final checkpoint's LR is optim.min_lr exactly, and the plan never lifts the LR
    by more than one warm-up increment: from the plan on it only decays (train.log_every=1 to see each
    step's LR)."""
    import re

    run = tmp_path / "run"
    proc = pretrain(
        "train", "--out", str(run), "--set", "train.max_hours=0.03", "--set", "train.log_every=1", timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    planned = re.search(r"max_hours: the LR schedule ends at step (\d+) \((\d+) steps from now", proc.stdout)
    assert planned, proc.stdout[-3000:]
    end, start = int(planned[1]), int(planned[1]) - int(planned[2])
    assert (
        f"planned end: reached step {end}, where the LR schedule planned for max_hours=0.03 ends"
        in proc.stdout
    )
    last = _ends_annealed(run, 0.0002, 0.0018, 0.0)
    assert last["step"] == end and last["lr"] == 0.0002
    lrs = {row["step"]: row["lr"] for row in train_rows(run)}  # a row's lr made that step's weights
    steps = sorted(lrs)
    assert steps == list(range(1, end + 1))
    rises = [lrs[b] - lrs[a] for a, b in zip(steps, steps[1:], strict=False)]
    tiny = load_config("tiny")
    increment = tiny.optim.lr / tiny.schedule.warmup_steps
    assert max(rises) <= increment + 1e-12, lrs  # one warm-up increment at most (it jumped to 2.7x)
    assert all(rise < 0 for rise in rises[start:]), lrs  # from the plan's first step (row start + 1) on


@pytest.mark.slow  # two clock-bound runs of 14 and 29 s (the first shared with the test above)
def test_a_finished_max_hours_run_resumed_with_more_hours_trains_on_and_ends_annealed(tmp_path, clocked_runs):
    """A run that ended at its max_hours plan, resumed with twice the hours: the old plan is dropped (with a
    line saying so, and the LR change), a new end is planned from the pace and the run trains on to it,
    ending at min_lr on a checkpoint. Resumed with no clock and a larger max_steps, max_steps ends it."""
    import re
    import shutil

    args = clocked_args("wsd")
    ended, first = clocked_runs("wsd")
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    shutil.copytree(ended, run)
    end = _ends_annealed(run, 0.0002, 0.0018, 0.0)["step"]
    assert f"reached step {end}, where the LR schedule planned for max_hours=0.004 ends" in first.stdout
    more = pretrain("train", "--out", str(run), *args, "--set", "train.max_hours=0.008")
    assert more.returncode == 0, more.stderr
    assert (
        f"note: train.max_hours 0.004 -> 0.008: the LR schedule's planned end at step {end} is dropped"
        in (more.stdout)
    )
    planned = re.search(r"max_hours: the LR schedule ends at step (\d+)", more.stdout)
    assert planned and int(planned[1]) > end + 10, more.stdout[-3000:]
    assert f"planned end: reached step {planned[1]}, where the LR schedule planned for max_hours=0.008" in (
        more.stdout
    )
    assert _ends_annealed(run, 0.0002, 0.0018, 0.0)["step"] == int(planned[1])
    unclocked = ["--max-steps", str(int(planned[1]) + 3), "--set", "train.max_hours=0"]
    done = pretrain("train", "--out", str(run), *args, *unclocked)
    assert done.returncode == 0, done.stderr
    assert f"reached max_steps={int(planned[1]) + 3}" in done.stdout, done.stdout[-2000:]
