"""The warm start of the tests' CLI runs (tests/warm.py): a run forked from a process that has done the
imports must be the run a fresh `python -m app.cli` is: the same output, exit code and signals, in a
process of its own; a warm launcher's ranks, forked from it, must be the ranks torchrun starts. Where a
fresh interpreter is needed, a plain subprocess runs instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST, REPO, cli_env, losses_by_step, pretrain
from tests.procs import Proc, children
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
    assert not WARM.serves([sys.executable, "-m", "app.tools.bench"], cli_env(), REPO)  # not one it runs
    assert WARM.serves(cmd, cli_env(PYTHONPATH=str(REPO)), REPO)  # already first on sys.path
    assert not isinstance(Proc(cmd, warm=False).popen, WarmPopen)


def listening_sockets(pid: int) -> set[str]:
    """The `socket:[INODE]` links of the TCP sockets `pid` listens on (/proc/net/tcp, state 0A)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                listening.add(f"socket:[{fields[9]}]")
    fds = Path(f"/proc/{pid}/fd")
    return {os.readlink(fd) for fd in fds.iterdir()} & listening


def test_a_warm_launcher_forks_ranks_that_train_and_stop_as_torchruns_own_do(tmp_path):
    """A warm launcher (the container's, on torchrun's agent) forks its ranks from itself: each is the
    launcher's child in a session of its own (as torchrun's Popen makes it), holds none of the launcher's
    listening sockets (the rendezvous store must go with its launcher), trains the fresh ranks' losses,
    and stops on the launcher's SIGTERM."""
    shape = ["-m", "app.launch", "--standalone", "--nproc-per-node=2", "-m", "app.train", *FAST]
    fresh = Proc([sys.executable, *shape, "--out", str(tmp_path / "fresh"), "--max-steps", "3"], warm=False)
    warm_run = tmp_path / "warm"
    warm = Proc([sys.executable, *shape, "--out", str(warm_run), "--max-steps", "100000"])
    assert isinstance(warm.popen, WarmPopen)
    warm.wait_for_step(warm_run, 3)
    ranks = children(warm.pid)
    assert len(ranks) == 2, ranks
    for rank in ranks:
        assert os.getsid(rank) == rank
        assert not listening_sockets(rank) & listening_sockets(warm.pid)
    assert listening_sockets(warm.pid), "torchrun's store listens in the launcher"
    warm.signal(signal.SIGTERM)
    assert warm.wait(120) == 143, warm.tail()
    assert fresh.wait(300) == 0, fresh.tail()
    assert (warm_run / "checkpoints").is_dir()
    fresh_losses = losses_by_step(tmp_path / "fresh")
    assert len(fresh_losses) == 3
    assert fresh_losses == {step: losses_by_step(warm_run)[step] for step in fresh_losses}


def test_a_pause_hook_reaches_a_function_the_project_imported_by_name(tmp_path):
    """tests/pause_at.py run warm: app/trainer/startup.py imported build_parallel_model by name before
    the hook wrapped it, and still stops there."""
    env = cli_env(
        PRETRAIN_TEST_PAUSE="app.trainer.parallel.parallelize:build_parallel_model",
        PRETRAIN_TEST_PAUSE_DIR=str(tmp_path),
    )
    args = ["train", "--out", str(tmp_path / "run"), *FAST, "--max-steps", "1"]
    proc = Proc([sys.executable, "-m", "tests.pause_at", "app.cli", *args], env=env)
    assert isinstance(proc.popen, WarmPopen)
    proc.wait_for_file(lambda: list(tmp_path.glob(f"paused-{proc.pid}")))
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))  # stopped before the model was built
    proc.signal(signal.SIGCONT)
    assert proc.wait(120) == 0, proc.tail()
    assert "RuntimeWarning" not in proc.output  # app.cli ran as __main__ only, as under `python -m`
