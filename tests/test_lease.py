"""The run-dir lease (app/trainer/stopping/lease.py): one trainer writes a run dir. Real processes hold, die,
hang and wait; the trainer test runs two real `pretrain train` processes on one run dir."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from app.trainer.stopping.lease import BUSY_EXIT, LEASE, LeaseNotTaken, RunLease
from tests.conftest import FAST, pretrain, pretrain_meanwhile, spawn_train
from tests.procs import Proc
from tests.test_resume import assert_same_run

HOLDER = """
import sys, time
from app.trainer.stopping.lease import RunLease
lease = RunLease(sys.argv[1], wait_seconds=30, stale_seconds=float(sys.argv[2]))
lease.acquire()
print("held", flush=True)
time.sleep(120)
"""


def hold(run: Path, stale: float = 60.0) -> Proc:
    """Another process holding the lease of `run` (with its heartbeat thread); stopped at the test's end."""
    proc = Proc([sys.executable, "-c", HOLDER, str(run), str(stale)])
    assert proc.wait_for_line(r"^held$")
    return proc


def test_a_second_holder_waits_and_gives_up_with_a_retryable_code(tmp_path):
    holder = hold(tmp_path)
    logs: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(LeaseNotTaken) as e:
        RunLease(tmp_path, wait_seconds=1.5, stale_seconds=60, log=logs.append, poll_seconds=0.1).acquire()
    assert 1.5 <= time.monotonic() - t0 < 10
    assert e.value.exit_code == BUSY_EXIT >= 128  # the PyTorchJob ExitCode policy retries >= 128
    assert f"pid {holder.pid}" in str(e.value) and "checkpoint.lease_wait_seconds" in str(e.value)
    assert logs and "waiting" in logs[0] and f"pid {holder.pid}" in logs[0]
    assert json.loads((tmp_path / LEASE).read_text())["pid"] == holder.pid, "the holder keeps it"


def test_released_lease_is_taken_at_once_and_deleted_on_release(tmp_path):
    holder = hold(tmp_path)
    logs: list[str] = []
    lease = RunLease(tmp_path, wait_seconds=30, stale_seconds=60, log=logs.append, poll_seconds=0.1)
    threading.Timer(1.0, lambda: holder.send_signal(signal.SIGTERM)).start()
    try:
        # SIGTERM kills the holder: a dead process on this machine, taken over without waiting 60 s
        t0 = time.monotonic()
        lease.acquire()
        assert time.monotonic() - t0 < 10
        assert any("took over" in m and "is gone" in m for m in logs), logs
        assert json.loads((tmp_path / LEASE).read_text())["pid"] == os.getpid()
    finally:
        lease.release()
    assert not (tmp_path / LEASE).exists()


def test_a_hung_holder_is_taken_over_after_the_stale_time_and_then_exits_without_writing(tmp_path):
    """A holder that stops heartbeating (a hung or partitioned node; here SIGSTOP) loses the lease after
    checkpoint.lease_stale_seconds; when it wakes up it exits 142 at once instead of writing on."""
    holder = hold(tmp_path, stale=1.5)
    logs: list[str] = []
    lease = RunLease(tmp_path, wait_seconds=30, stale_seconds=1.5, log=logs.append, poll_seconds=0.1)
    try:
        holder.send_signal(signal.SIGSTOP)
        lease.acquire()
        assert any("took over" in m and "heartbeat" in m for m in logs), logs
        holder.send_signal(signal.SIGCONT)
        assert holder.wait(15) == BUSY_EXIT
        assert "lost the run dir lease" in holder.output
        assert json.loads((tmp_path / LEASE).read_text())["owner"] == lease.owner
    finally:
        lease.release()


def test_a_lease_left_on_another_machine_is_taken_over_by_its_age(tmp_path):
    """A lease whose holder ran elsewhere (another pod or node) and stopped beating long ago."""
    old = {"owner": "x", "host": "node-7", "pid": 1, "boot_id": "other", "pidns": "pid:[1]", "start": "1"}
    (tmp_path / LEASE).write_text(json.dumps({**old, "beat": 9, "heartbeat_unix": time.time() - 600}))
    logs: list[str] = []
    lease = RunLease(tmp_path, wait_seconds=30, stale_seconds=60, log=logs.append)
    t0 = time.monotonic()
    lease.acquire()
    lease.release()
    assert time.monotonic() - t0 < 5
    assert any("took over" in m and "node-7" in m and "600 s old" in m for m in logs), logs


def test_trainer_on_a_held_run_dir_exits_142_or_143_with_one_line(tmp_path):
    hold(tmp_path)
    busy = pretrain("train", "--out", str(tmp_path), *FAST, "--set", "checkpoint.lease_wait_seconds=1")
    assert busy.returncode == BUSY_EXIT, busy.stdout + busy.stderr
    assert busy.stderr.count("\n") == 1 and "still written by" in busy.stderr
    assert "Traceback" not in busy.stdout + busy.stderr
    proc = spawn_train("--out", str(tmp_path), *FAST, "--max-steps", "4")
    proc.wait_for_line("waiting up to")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 143
    assert time.monotonic() - t0 < 15, "SIGTERM while waiting must not wait out the lease (600 s)"
    out = proc.output
    assert "stopped by SIGTERM while waiting" in out and "Traceback" not in out
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_two_trainers_on_one_run_dir_take_turns_and_end_like_one_run(tmp_path):
    """A restarted pod (B) starts while the old one (A) still runs on the same ReadWriteMany run dir: B
    waits, A is stopped (SIGTERM, checkpoint, 143), B takes the lease, resumes, and the final weights and
    losses equal one uninterrupted run."""
    steps = 10
    args = [*FAST, "--max-steps", str(steps), "--set", "checkpoint.lease_stale_seconds=600"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    reference = pretrain_meanwhile("train", "--out", str(straight), *args)
    a = spawn_train("--out", str(run), *args)
    a.wait_for_step(run, 2)
    a.send_signal(signal.SIGSTOP)  # hold A mid-run (its heartbeat too) while B starts
    b = spawn_train("--out", str(run), *args)
    b.wait_for_line("only one trainer may write a run dir")
    assert b.poll() is None
    a.send_signal(signal.SIGTERM)
    a.send_signal(signal.SIGCONT)
    assert a.wait(120) == 143, a.output
    assert b.wait(180) == 0, b.output
    a_out, b_out = a.output, b.output
    assert "Traceback" not in a_out + b_out
    stopped = int(a_out.split("stopping at step ")[1].split(":")[0])
    assert 2 <= stopped < steps and f"resumed from {run / 'checkpoints'}" in b_out
    assert reference.finished().returncode == 0
    assert_same_run(straight, run, steps)
