"""Asynchronous saves with real processes and real signals: a SIGKILL while a background write runs
leaves the previous checkpoint the latest valid one (and the resumed run equals a straight one); a
SIGTERM while a write is pending exits 143 only once that write is committed."""

from __future__ import annotations

import signal
import time

import pytest

from app.trainer.checkpoint import store as ckpt
from tests.conftest import (
    FAST,
    kill_inside_a_write,
    pretrain,
    pretrain_meanwhile,
    spawn_train,
    train_rows,
    wait_for_step,
)
from tests.test_resume import assert_same_run

# A model whose save takes long enough (~25 MB of weights and AdamW state) to be caught mid-write; a
# save after every step, so that a write is nearly always in flight while the loop trains on.
SAVING = [
    *FAST,
    "--set",
    "model.d_model=256",
    "--set",
    "checkpoint.every_steps=1",
    "--set",
    "checkpoint.async_save=true",
]


def temp_dirs(run):
    root = ckpt.checkpoints_root(run)
    return sorted(p.name for p in root.glob(".tmp-*")) if root.is_dir() else []


def signal_during_a_write(run, proc, sig, after_step):
    """Send `sig` the moment a background write is seen in flight (its temp dir exists while the loop
    has already logged a later step); returns the temp dirs seen then."""
    wait_for_step(run, after_step, proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        tmp = temp_dirs(run)
        if tmp:
            proc.send_signal(sig)
            return tmp
        time.sleep(0.001)
    raise AssertionError("no write in flight seen")


def test_sigkill_during_an_async_write_keeps_the_previous_checkpoint(tmp_path, procs):
    """The writer thread stops itself inside step 3's optimizer file (the 6th file it writes: a model and an
    optimizer file per step; tests/pause_at.py), the model file already in the temp dir; a SIGKILL lands
    there. The run resumes from step 2 and equals a straight one."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = [*FAST, "--set", "checkpoint.every_steps=1", "--set", "checkpoint.async_save=true"]
    args += ["--max-steps", "8"]
    reference = pretrain_meanwhile("train", "--out", str(ref), *args)
    kill_inside_a_write(procs, run, args, tmp_path, 6)
    assert temp_dirs(run) == [".tmp-step_000003"]  # the write in flight, cut short
    latest = ckpt.resolve_latest(run, warn=pytest.fail)
    assert latest is not None and latest.step == 2  # the one before it
    resumed = pretrain("train", "--out", str(run), *args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {latest.path}" in resumed.stdout
    assert temp_dirs(run) == []  # cleaned at start
    assert reference.finished().returncode == 0
    assert_same_run(ref, run, 8)


def test_sigterm_with_a_write_pending_exits_143_once_it_is_committed(tmp_path):
    run = tmp_path / "run"
    proc = spawn_train(
        "--out", str(run), *SAVING, "--max-steps", "100000", "--set", "checkpoint.keep_last=1000"
    )
    in_flight = signal_during_a_write(run, proc, signal.SIGTERM, 3)
    assert proc.wait(60) == 143
    out = proc.output
    assert "preempted: SIGTERM" in out
    assert temp_dirs(run) == []  # nothing was left half-written
    last = train_rows(run)[-1]["step"]
    committed = {p.name for p in ckpt.list_checkpoints(run)}
    assert in_flight[0].removeprefix(".tmp-") in committed  # the write pending at the signal finished
    latest = ckpt.resolve_latest(run, warn=pytest.fail)
    assert latest.step == last  # the stop ends on a complete, verified checkpoint of the last step
    events = [r for r in train_rows(run, "event") if r.get("event") == "stop"]
    saves = train_rows(run, "checkpoint")
    assert events and saves[-1]["step"] == last  # the last step's save was reported before the exit
    background = [r for r in saves if r["write_seconds"] > 0]
    assert background and all(r["blocking_seconds"] < r["seconds"] for r in background)


def test_the_budget_projection_reserves_a_background_write(tmp_path):
    """status.json carries the background part of the last save; the watcher's horizon adds it once more
    (a stop first waits for a write still in flight, then saves), so the graceful stop comes earlier."""
    from app.budget.files import read_status
    from app.budget.policy import PolicyInput, decide
    from app.trainer.checkpoint.writer import SaveResult
    from app.trainer.stopping.heartbeat import Heartbeat

    save = SaveResult(tmp_path, 10, seconds=30.0, blocking_seconds=2.0, write_seconds=28.0, bytes=1)
    Heartbeat(tmp_path).write("running", 10, 100, 1.0, 10, save)
    status = read_status(tmp_path / "status.json")
    assert (status.checkpoint_seconds, status.checkpoint_write_seconds) == (30.0, 28.0)
    base = dict(spent_usd=90.0, cap_usd=100.0, rate_usd_per_hour=36.0, step_seconds=1.0, margin_seconds=60.0)
    sync = decide(PolicyInput(**base, checkpoint_seconds=30.0))
    pending = decide(PolicyInput(**base, checkpoint_seconds=30.0, checkpoint_write_seconds=28.0))
    assert pending.horizon_seconds == sync.horizon_seconds + 28.0
    assert pending.seconds_to_stop == pytest.approx(sync.seconds_to_stop - 28.0)
