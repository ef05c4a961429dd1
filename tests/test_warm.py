"""The warm start of the tests' CLI runs (tests/warm.py): a run forked from a process that has done the
imports must be the run a fresh `python -m app.cli` is: the same output, exit code and signals, in a
process of its own. Where a fresh interpreter is needed, a plain subprocess runs instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import FAST, REPO, cli_env, pretrain
from tests.procs import Proc
from tests.warm import WARM, WarmPopen

COMMANDS = {
    "print-config": ["train", "--preset", "tiny-speedrun", "--print-config"],
    "bad-input": ["train", "--print-config", "--set", "optim.eps=0"],
    "plan": ["plan", "--budget-usd", "9", "--gpu", "h100-sxm"],
    "help": ["train", "--help"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_warm_run_prints_and_exits_as_a_fresh_interpreter_does(name):
    args = COMMANDS[name]
    fresh = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    warm = pretrain(*args)
    assert WARM.serves([sys.executable, "-m", "app.cli"], cli_env(), REPO)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_warm_trainer_is_a_process_of_its_own_that_takes_signals(tmp_path):
    run = tmp_path / "run"
    proc = Proc([sys.executable, "-m", "app.cli", "train", "--out", str(run), *FAST, "--max-steps", "100000"])
    assert isinstance(proc.popen, WarmPopen)
    proc.wait_for_step(run, 2)
    # its own session (as a Proc started fresh) and the working directory it was given
    assert os.getsid(proc.pid) == proc.pid != os.getpid()
    assert os.readlink(f"/proc/{proc.pid}/cwd") == str(REPO)
    proc.signal(signal.SIGTERM)
    assert proc.wait(120) == 143, proc.tail()
    assert "checkpoint step" in proc.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))


def test_a_run_killed_by_a_signal_reports_it_as_popen_does(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "app.cli", "train", "--out", str(run), *FAST, "--max-steps", "100000"]
    proc = Proc(cmd)
    proc.wait_for_step(run, 1)
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL


def test_a_warm_run_has_the_environment_it_was_given(tmp_path):
    """The run's os.environ is the one given (/proc/PID/environ still shows the warm process's: a fork
    has no exec), here MLFLOW_TRACKING_URI, which the MLflow tracker reads when the run starts."""
    store = tmp_path / "mlruns"
    args = ["train", "--out", str(tmp_path / "run"), *FAST, "--max-steps", "1"]
    proc = pretrain(
        *args, "--set", "metrics.trackers=mlflow", env=cli_env(MLFLOW_TRACKING_URI=store.as_uri())
    )
    assert proc.returncode == 0, proc.stderr
    assert list(store.glob("*/*/meta.yaml")), "the run's MLflow store is where the environment said"


def test_what_is_read_at_import_time_set_otherwise_gets_a_fresh_interpreter(tmp_path):
    pretrain("train", "--print-config", check=True)  # the warm process runs, with the tests' environment
    cmd = [sys.executable, "-m", "app.cli", "train", "--print-config"]
    for changed in ({"TORCH_LOGS": "recompiles"}, {"OMP_NUM_THREADS": "2"}, {"PYTHONHASHSEED": "3"}):
        assert not WARM.serves(cmd, cli_env(**changed), REPO), changed
        proc = Proc(cmd, env=cli_env(**changed))
        assert isinstance(proc.popen, subprocess.Popen) and proc.wait(120) == 0, proc.tail()
    assert not WARM.serves(cmd, cli_env(), tmp_path)  # another working directory
    assert not WARM.serves([sys.executable, "-m", "tests.pause_at", "app.cli"], cli_env(), REPO)
    assert not isinstance(Proc(cmd, warm=False).popen, WarmPopen)
