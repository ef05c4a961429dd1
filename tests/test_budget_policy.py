"""The budget policy: its thresholds, and 100 randomized jobs under the real watcher on a simulated clock.

The simulation (app/budget/simulate.py) runs the real Watcher, ledger, stop file and billing-file source;
only time and the trainer are simulated: random rates, step and checkpoint times with jitter, billing files
that go missing, malformed or stale, SIGTERM/SIGKILL preemptions and restarts.
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from app.budget.policy import PolicyInput, decide, graceful_point_seconds, horizon_seconds
from app.budget.simulate import SimParams, simulate, summary


def inp(**kw) -> PolicyInput:
    base = dict(
        spent_usd=0.0, cap_usd=100.0, rate_usd_per_hour=36.0, step_seconds=1.0, checkpoint_seconds=20.0
    )
    base.update(poll_seconds=10.0, margin_seconds=60.0)
    base.update(kw)
    return PolicyInput(**base)


# rate 36 $/h = 0.01 $/s; horizon = 10 + 1 + 20 + 60 = 91 s = $0.91


def test_ok_far_from_the_cap():
    d = decide(inp(spent_usd=10.0))
    assert (d.state, d.stop) == ("ok", "")
    assert d.projected_total_usd == pytest.approx(10.91)
    assert d.seconds_to_cap == pytest.approx(9000.0)
    assert d.seconds_to_stop == pytest.approx(9000.0 - 91.0)


def test_alert_by_fraction_and_by_amount():
    assert decide(inp(spent_usd=80.0)).state == "alert"
    assert decide(inp(spent_usd=79.9)).state == "ok"
    assert decide(inp(spent_usd=50.0, alert_usd=50.0)).state == "alert"


def test_graceful_exactly_when_the_projection_reaches_the_cap():
    assert decide(inp(spent_usd=100.0 - 0.92)).stop == ""
    d = decide(inp(spent_usd=100.0 - 0.90))
    assert (d.stop, d.state) == ("graceful", "stopping")
    assert "cap" in d.reason


def test_graceful_is_not_asked_twice():
    d = decide(inp(spent_usd=99.5, stopping="graceful"))
    assert (d.stop, d.state) == ("", "stopping")


def test_immediate_when_spent_reaches_the_cap():
    d = decide(inp(spent_usd=100.0))
    assert (d.stop, d.state) == ("immediate", "exhausted")
    assert decide(inp(spent_usd=101.0, stopping="immediate")).stop == ""


def test_immediate_when_a_graceful_stop_no_longer_fits():
    # step + checkpoint = 21 s = $0.21: with $0.15 left a graceful stop would cross the cap
    d = decide(inp(spent_usd=99.85))
    assert d.stop == "immediate" and "no room" in d.reason


def test_escalates_when_a_graceful_stop_runs_long():
    assert decide(inp(spent_usd=99.85, stopping="graceful")).stop == ""
    d = decide(inp(spent_usd=99.95, stopping="graceful"))  # $0.10 per poll: crossed before the next look
    assert (d.stop, d.state) == ("immediate", "exhausted")


def test_rate_zero_never_projects():
    d = decide(inp(spent_usd=50.0, rate_usd_per_hour=0.0))
    assert d.seconds_to_cap is None and d.stop == ""


def test_decay_starts_when_the_rest_equals_the_decay_phase():
    # decay phase = 15% of what the cap buys: 0.15 * 100 / 0.01 = 1500 s before the graceful stop
    assert not decide(inp(spent_usd=100 - 0.91 - 15.1)).decay
    assert decide(inp(spent_usd=100 - 0.91 - 14.9)).decay


def _check(results, min_mean: float) -> None:
    lines = []
    for r in results:
        p = r.params
        where = f"seed {p.seed} ({p.source}, {len(p.preempt_uptimes)} preemptions)"
        assert r.true_spent_usd <= p.cap_usd, f"{where}: spent ${r.true_spent_usd:.4f} > cap ${p.cap_usd:.4f}"
        assert r.ledger_spent_usd >= r.true_spent_usd * (1 - 1e-9), f"{where}: the ledger under-counts"
        assert r.restart_refused, f"{where}: a restart after the budget stop trained again"
        if r.graceful_was_possible():
            assert r.end in ("graceful", "graceful-killed"), (
                f"{where}: ended {r.end} though a graceful stop fit"
            )
        lines.append(r.fraction)
    s = summary(results)
    print(
        f"\nfinal spend / cap over {s['runs']} runs: mean {s['mean']:.4f} min {s['min']:.4f} max {s['max']:.4f}"
    )
    print("endings:", dict(Counter(r.end for r in results)))
    assert s["max"] <= 1.0
    assert s["mean"] >= min_mean


def _sim_dir() -> str:
    return tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)


def test_100_randomized_short_runs_never_cross_the_cap():
    """Short jobs (0.5-2 h) keep the default suite fast; the long ones below are marked slow."""
    logging.disable(logging.WARNING)
    try:
        root = Path(_sim_dir())
        results = [
            simulate(s, root, SimParams.random(s, hours=(0.5, 2.0), poll=(20, 60))) for s in range(100)
        ]
    finally:
        logging.disable(logging.NOTSET)
    assert sum(r.fallbacks > 0 for r in results) >= 10, "the runs should exercise source failures"
    assert sum(len(r.segments) > 1 for r in results) >= 30, "the runs should exercise restarts"
    _check(results, min_mean=0.95)


@pytest.mark.slow
def test_100_randomized_long_runs_spend_98_percent_of_the_cap():
    logging.disable(logging.WARNING)
    try:
        root = Path(_sim_dir())
        results = [simulate(1000 + s, root) for s in range(100)]
    finally:
        logging.disable(logging.NOTSET)
    _check(results, min_mean=0.98)


def test_a_kill_during_the_graceful_checkpoint_still_refuses_the_restart(tmp_path):
    p = SimParams(
        seed=5,
        rate_usd_per_hour=10.0,
        cap_usd=10.0,  # 1 h
        step_seconds=2.0,
        checkpoint_seconds=60.0,
        checkpoint_every_seconds=600.0,
        startup_seconds=30.0,
        poll_seconds=15.0,
        step_jitter=0.0,
        checkpoint_jitter=0.0,
        preempt_uptimes=[(3600 - 100, "kill")],  # lands inside the final checkpoint
    )
    r = simulate(5, tmp_path, p)
    assert r.end == "graceful-killed" and r.restart_refused
    assert r.true_spent_usd <= p.cap_usd


@pytest.mark.parametrize(
    ("poll", "margin", "step", "ckpt"),
    [(10, 2, 0.5, 1.0), (10, 0, 0.1, 0.1), (60, 0, 1, 30), (5, 60, 1, 20), (1, 0, 30, 120)],
)
def test_the_graceful_window_is_at_least_one_poll(poll, margin, step, ckpt):
    """Between "a graceful stop is asked" (projection >= cap) and "no room for one" (spent + r*G >= cap)
    lies H - G of spend time; a poll that lands nowhere inside it skips the graceful stop."""
    timing = dict(poll_seconds=poll, margin_seconds=margin, step_seconds=step, checkpoint_seconds=ckpt)
    i = inp(**timing)
    assert horizon_seconds(i) - graceful_point_seconds(i) >= poll + margin
    # walk a run poll by poll towards the cap at $36/h: the first stop asked is always graceful
    spent, first = 100.0 - 0.01 * (horizon_seconds(i) + 3 * poll), ""
    while not first:
        first = decide(inp(spent_usd=spent, **timing)).stop
        spent += 0.01 * poll
    assert first == "graceful"


def test_a_poll_longer_than_step_checkpoint_and_margin_still_stops_on_a_checkpoint(tmp_path):
    """The reported case: poll 10 s, margin 2 s, a $0.06 cap at $3.60/h, half-second steps. With the
    old horizon (poll + step + checkpoint + margin = 13.5 s) a poll jumped over the 3.5 s window and the
    run ended with an immediate stop, its 90 steps lost."""
    p = SimParams(
        seed=7,
        rate_usd_per_hour=3.6,
        cap_usd=0.06,
        step_seconds=0.5,
        checkpoint_seconds=1.0,
        checkpoint_every_seconds=600.0,
        startup_seconds=5.0,
        poll_seconds=10.0,
        margin_seconds=2.0,
        step_jitter=0.0,
        checkpoint_jitter=0.0,
    )
    r = simulate(7, tmp_path, p)
    assert (r.end, r.lost_steps, r.checkpoints) == ("graceful", 0, 1)
    assert r.true_spent_usd <= p.cap_usd and r.restart_refused


def test_random_poll_margin_step_and_checkpoint_times_stop_on_a_checkpoint():
    """40 jobs with random timing settings (the benchmark runs 300): every budget stop ends on a
    checkpoint, unless the cap does not even pay for the start-up, one step and one checkpoint."""
    logging.disable(logging.WARNING)
    try:
        root = Path(_sim_dir())
        results = [simulate(s, root, SimParams.random_timing(s)) for s in range(40)]
    finally:
        logging.disable(logging.NOTSET)
    checked = [r for r in results if r.params.affords_step_and_checkpoint()]
    assert len(checked) >= 30
    lost = [(r.params.seed, r.end, r.lost_steps) for r in checked if r.lost_steps]
    assert not lost, f"budget stops that threw away trained steps: {lost}"
    assert all(r.restart_refused for r in results)
