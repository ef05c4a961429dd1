"""A full checkpoint volume: the save that fails for space ends the run with one line and exit 6, removes
its temp dir, leaves the earlier checkpoints as they were, and the run resumes exactly once there is room.

The volume fills up for real where this user may mount a tmpfs (root); everywhere the failure is also
injected at the writer's first file (drill.volume_full_after_step: saves of later steps raise ENOSPC
there, after a partial temp dir exists)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import CLASSIC, cli_env, pretrain, pretrain_meanwhile
from tests.conftest import FAST as SMALL
from tests.test_resume import assert_same_run

# the volume sizes below are set on the AdamW recipe's checkpoint of the small model
FAST = [*SMALL, *CLASSIC]

STEPS = 30
EVERY = ["--set", "checkpoint.every_steps=10"]
FULL_AFTER_10 = ["--set", "drill.volume_full_after_step=10"]


def assert_out_of_space(proc_code: int, stderr: str, run: Path, newest: int) -> None:
    assert proc_code == 6, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if not line.startswith("warning:")]
    assert len(errors) == 1 and errors[0].startswith("error: out of space on the checkpoint volume"), stderr
    assert f"resumes from step_{newest:06d}, intact" in errors[0] and "free" in errors[0], errors[0]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[-1] == f"step_{newest:06d}" and not [n for n in names if n.startswith(".")], names
    status = json.loads((run / "status.json").read_text())
    assert status["last_checkpoint_step"] == newest and status["state"] == "failed", status


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run, trained in the background while a test fills its volume: call it for the
    run dir once it is needed."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = pretrain_meanwhile("train", "--out", str(run), "--max-steps", str(STEPS), *FAST)

    def finished() -> Path:
        assert proc.finished().returncode == 0, proc.tail()
        return run

    return finished


def test_periodic_save_out_of_space_exits_6_and_resumes_exactly(tmp_path, straight):
    run = tmp_path / "run"
    failed = pretrain("train", "--out", str(run), "--max-steps", str(STEPS), *FAST, *EVERY, *FULL_AFTER_10)
    assert_out_of_space(failed.returncode, failed.stderr, run, newest=10)
    assert "at step 20: a checkpoint needs about" in failed.stderr
    resumed = pretrain("train", "--out", str(run), "--max-steps", str(STEPS), *FAST, *EVERY, check=True)
    assert "resumed from" in resumed.stdout
    assert_same_run(straight(), run, STEPS)


@pytest.mark.slow  # over 8 s: `make test-slow` (CI runs it); keeps `make test` near 10 min
def test_sigterm_save_out_of_space_says_so_and_resumes_exactly(tmp_path, straight, procs):
    """SIGTERM at step 15 (the trainer stops itself before it, tests/pause_at.py): the stop's save fails."""
    run, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    env = cli_env(PRETRAIN_TEST_PAUSE="app.train:train_step:15", PRETRAIN_TEST_PAUSE_DIR=str(marks))
    cmd = ["-m", "tests.pause_at", "app.cli", "train", "--out", str(run)]
    proc = procs.python(
        *cmd, "--max-steps", str(STEPS), *FAST, *EVERY, *FULL_AFTER_10, env=env, separate_stderr=True
    )
    proc.wait_paused(marks)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    code = proc.wait(60)
    stderr = proc.errors
    assert_out_of_space(code, stderr, run, newest=10)
    assert "at step 15 (the save for the stop: preempted)" in stderr
    pretrain("train", "--out", str(run), "--max-steps", str(STEPS), *FAST, *EVERY, check=True)
    assert_same_run(straight(), run, STEPS)


@pytest.mark.slow  # mounts a tmpfs and fills it
def test_a_real_full_tmpfs_warns_first_then_exits_6(tmp_path, straight):
    """An 8 MB tmpfs holds two of these 2.9 MB checkpoints: the warning comes at start, the save of step
    30 fails; after the volume grows, the run resumes exactly."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(volume)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not allowed here (the injected tests above cover the behaviour)")
    try:
        run = volume / "run"
        failed = pretrain("train", "--out", str(run), "--max-steps", str(STEPS), *FAST, *EVERY)
        assert_out_of_space(failed.returncode, failed.stderr, run, newest=20)
        warnings = failed.stderr.splitlines()[:-1]  # at start (an estimate), after step 10, after step 20
        assert all(w.startswith("warning: a checkpoint needs about") for w in warnings) and len(warnings) == 3
        assert "save 2 from now will fail" in warnings[1] and "the next save will fail" in warnings[2]
        subprocess.run(["mount", "-o", "remount,size=64m", str(volume)], check=True)
        pretrain("train", "--out", str(run), "--max-steps", str(STEPS), *FAST, *EVERY, check=True)
        assert_same_run(straight(), run, STEPS)
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)
