"""The launcher's retry budget and data gate (app/restarts.py).

Under the PyTorchJob ExitCode policy the training-operator retries codes >= 128 forever
(kubeflow/trainer#2045); the launcher counts failed attempts without progress in the run dir and
turns the one past `trainer.maxRestarts` into exit 5, which the operator treats as permanent. The
rule is tested in-process around a stand-in for torchrun's main; the wiring with the real
`python -m app.launch` (torchrun, a worker process) at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from app import restarts
from app.restarts import EXIT_DATA_NOT_READY, EXIT_RETRIES_SPENT, RetryBudget, latest_checkpoint_step
from tests.procs import Proc

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pod(tmp_path, monkeypatch) -> Path:
    """The environment the chart gives the trainer container, with its paths under tmp_path."""
    (tmp_path / "run").mkdir()
    (tmp_path / "termination-log").write_text("")
    for key, value in {
        "PRETRAIN_RUN_DIR": str(tmp_path / "run"),
        "PRETRAIN_MAX_RESTARTS": "2",
        "PRETRAIN_RESTARTS_EPOCH": "1",
        "PRETRAIN_TERMINATION_LOG": str(tmp_path / "termination-log"),
        "PRETRAIN_DATA_VERDICT": str(tmp_path / "verdict.json"),
        "PET_NODE_RANK": "0",
    }.items():
        monkeypatch.setenv(key, value)
    return tmp_path


def attempt(pod: Path, code: int, ckpt_step: int = 0) -> tuple[int, bool]:
    """One pod start: (exit code of the launcher, whether the trainer ran)."""
    ran = []

    def trainer(argv):
        ran.append(argv)
        if ckpt_step:
            d = pod / "run" / "checkpoints" / f"step_{ckpt_step:06d}"
            d.mkdir(parents=True)
            (d / "meta.json").write_text("{}")
        return code

    return restarts.gated(trainer, ["-m", "app.train"]), bool(ran)


def state(pod: Path, node: int = 0) -> dict:
    return json.loads((pod / "run" / "restarts" / f"node-{node}.json").read_text())


def test_repeated_crashes_end_with_a_permanent_code(pod, capsys):
    """maxRestarts=2: two OOM kills are retried (137 kept), the third turns into exit 5 with the reason
    on stderr and in the pod's termination message; a pod the operator starts anyway is refused."""
    assert attempt(pod, 137) == (137, True)
    assert "failure 1 of 3 allowed in a row" in capsys.readouterr().err
    assert attempt(pod, 139) == (139, True)
    assert attempt(pod, 137) == (EXIT_RETRIES_SPENT, True)
    msg = (pod / "termination-log").read_text().strip()
    assert len(msg.splitlines()) == 1 and msg in capsys.readouterr().err
    assert "3 failed attempts in a row without a new checkpoint (exit codes 137, 139, 137" in msg
    assert "trainer.maxRestarts=2" in msg and "kubeflow/trainer#2045" in msg and "helm upgrade" in msg
    assert attempt(pod, 0) == (EXIT_RETRIES_SPENT, False), "a refused attempt must not start the trainer"
    assert state(pod)["attempts"][-1]["refused"] is True
    # a new release revision (helm upgrade after fixing the cause) starts a new count
    os.environ["PRETRAIN_RESTARTS_EPOCH"] = "2"
    assert attempt(pod, 137) == (137, True)
    assert state(pod)["failures"] == 1


def test_progress_and_preemption_do_not_count(pod):
    """A crash after a new checkpoint made progress; SIGTERM/SIGINT (143/130) are stop requests."""
    for step, code in [
        (100, 139),
        (200, 139),
        (0, 143),
        (0, 130),
        (0, 142),
        (0, 143),
        (300, 134),
        (400, 137),
    ]:
        assert attempt(pod, code, step) == (code, True)
    st = state(pod)
    assert st["failures"] == 0 and st["checkpoint_step"] == 400
    assert [a["counted"] for a in st["attempts"]] == [False] * 8
    # progress made by another node (a newer checkpoint seen at start) resets this node's count too
    attempt(pod, 137)
    attempt(pod, 137)
    assert state(pod)["failures"] == 2
    d = pod / "run" / "checkpoints" / "step_000500"
    d.mkdir()
    (d / "meta.json").write_text("{}")
    assert attempt(pod, 137) == (137, True)
    assert state(pod)["failures"] == 1


def test_a_lost_node_is_retried_and_counts_like_a_crash_without_a_new_checkpoint(pod):
    """144 (a peer rank or node lost): retried; a loop of losses without progress ends the job (exit 5),
    a loss after a new checkpoint does not count."""
    assert attempt(pod, 144, 100) == (144, True)
    assert state(pod)["failures"] == 0
    assert attempt(pod, 144) == (144, True)
    assert attempt(pod, 144) == (144, True)
    assert attempt(pod, 144) == (EXIT_RETRIES_SPENT, True)


def test_permanent_codes_are_kept(pod):
    for _ in range(4):
        assert attempt(pod, 2) == (2, True)  # 1-127 fail the job anyway; nothing to replace


def test_an_attempt_without_a_record_counts(tmp_path):
    """A pod that vanished (SIGKILL, node lost) leaves an open attempt: the next start counts it."""
    RetryBudget(tmp_path, max_restarts=1, node_rank=3, epoch="7").begin()
    again = RetryBudget(tmp_path, max_restarts=1, node_rank=3, epoch="7")
    assert again.begin() == ""  # failure 1 (no record) is within the budget
    assert again.state["failures"] == 1 and again.state["attempts"][0]["exit_code"] is None
    refusal = RetryBudget(tmp_path, max_restarts=1, node_rank=3, epoch="7").begin()
    assert "exit codes none recorded, none recorded" in refusal
    assert not (tmp_path / "restarts" / "node-0.json").exists(), "each node rank keeps its own count"


def test_data_verdict_ends_the_pod_with_a_permanent_code(pod, capsys):
    """The wait-for-data step cannot fail the job itself (the operator would read 0xbeef, retryable):
    it leaves a verdict, and the launcher exits 4 with its reason, before the trainer starts."""
    reason = "prepare Job pretrain-prepare-0123abcd failed: BackoffLimitExceeded"
    (pod / "verdict.json").write_text(json.dumps({"code": 4, "reason": reason}))
    assert attempt(pod, 0) == (EXIT_DATA_NOT_READY, False)
    assert reason in capsys.readouterr().err and reason in (pod / "termination-log").read_text()
    (pod / "verdict.json").unlink()
    assert attempt(pod, 0) == (0, True)


def test_no_run_dir_no_gate(monkeypatch, tmp_path):
    monkeypatch.delenv("PRETRAIN_RUN_DIR", raising=False)
    monkeypatch.delenv("PRETRAIN_DATA_VERDICT", raising=False)
    for _ in range(5):
        assert restarts.gated(lambda argv: 137, []) == 137


def test_latest_checkpoint_ignores_temp_and_incomplete_dirs(tmp_path):
    ck = tmp_path / "checkpoints"
    for name, meta in [("step_000010", True), ("step_000020", False), (".tmp-step_000030", True)]:
        (ck / name).mkdir(parents=True)
        if meta:
            (ck / name / "meta.json").write_text("{}")
    assert latest_checkpoint_step(tmp_path) == 10
    shutil.rmtree(ck)
    assert latest_checkpoint_step(tmp_path) == 0


# ------------------------------------------------------------- the real launcher (torchrun + a worker)

WORKER = "import os, sys; open(os.environ['RAN'], 'a').write('x'); sys.exit(int(os.environ['CODE']))\n"


def _launch(work: Path, code: int, user: int | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "CODE": str(code),
        "RAN": str(work / "ran"),
        "PRETRAIN_RUN_DIR": str(work / "run"),
        "PRETRAIN_MAX_RESTARTS": "0",
        "PRETRAIN_RESTARTS_EPOCH": "1",
        "PET_NODE_RANK": "0",
    }
    cmd = [sys.executable, "-m", "app.launch", "--nnodes=1", "--nproc-per-node=1", "worker.py"]
    if user is not None:  # as the image's uid 1000 (root ignores permission bits)
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def work() -> Path:
    path = Path(tempfile.mkdtemp())  # world-readable: the uid-1000 run below must reach worker.py
    os.chmod(path, 0o755)
    (path / "worker.py").write_text(WORKER)
    (path / "run").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_launcher_ends_a_crash_loop(work):
    """maxRestarts=0: the worker's 139 becomes the launcher's exit 5; the next pod is refused."""
    proc = _launch(work, 139)
    assert proc.returncode == EXIT_RETRIES_SPENT, proc.stderr
    assert "1 failed attempts in a row without a new checkpoint (exit codes 139" in proc.stderr
    assert _launch(work, 0).returncode == EXIT_RETRIES_SPENT
    assert (work / "ran").read_text() == "x"


@pytest.mark.skipif(os.geteuid() != 0 and os.getuid() != 1000, reason="needs root (setpriv) or uid 1000")
def test_a_run_dir_the_trainer_cannot_write_is_one_line_and_permanent(work):
    run = work / "run"
    os.chmod(run, 0o755)  # as a fresh root-owned export: uid 1000 cannot create run/restarts
    if os.geteuid() != 0:
        os.chmod(run, 0o555)
    proc = _launch(work, 0, user=1000 if os.geteuid() == 0 else None)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"cannot write {run}/restarts as uid 1000 gid 1000" in line
    assert "volumePermissions.enabled=true" in line and "fsGroupPolicy" in line
    assert not (work / "ran").exists()


# ------------------------------------------------------------- two launchers on one node's state


RACE = """
import sys, time
from pathlib import Path
from app.restarts import RetryBudget
run, n, go = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
for _ in range(n):
    budget = RetryBudget(run, max_restarts=10**6, node_rank=0, epoch="1")
    assert budget.begin() == ""
    time.sleep(0.003)  # the attempt runs
    assert budget.end(137) == (137, "")
"""


def test_two_launchers_on_one_node_state_lose_no_attempt(tmp_path):
    """A recreated pod overlapping the terminating one (same node rank, one run dir): two real processes
    record 20 attempts each, as fast as they can. Every attempt is in the file with its own exit code,
    and each crash counts exactly once (none overwritten, none counted twice)."""
    n = 20
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    go = tmp_path / "go"
    racers = [Proc([sys.executable, "-c", RACE, str(tmp_path), str(n), str(go)], env=env) for _ in range(2)]
    time.sleep(0.5)  # both imported and polling
    go.touch()
    for p in racers:
        assert p.wait(timeout=120) == 0, p.output
    st = json.loads((tmp_path / "restarts" / "node-0.json").read_text())
    attempts = st["attempts"]
    assert len(attempts) == 2 * n and len({a["id"] for a in attempts}) == 2 * n
    assert sorted(Counter(a["pid"] for a in attempts).values()) == [n, n]
    assert all(a["exit_code"] == 137 and a["counted"] for a in attempts), attempts
    assert st["failures"] == 2 * n
    assert not list((tmp_path / "restarts").glob("*.lock*")), "the lock is released"


def test_a_terminating_pod_that_ends_late_replaces_the_guess(tmp_path):
    """The new pod starts while the old one still saves: it takes the old attempt for lost (no record,
    a failure); when the old one then ends with 143 (preempted), that guess is replaced, not counted."""
    old = RetryBudget(tmp_path, max_restarts=1, node_rank=0, epoch="1")
    assert old.begin() == ""
    new = RetryBudget(tmp_path, max_restarts=1, node_rank=0, epoch="1")
    assert new.begin() == ""
    assert json.loads((tmp_path / "restarts" / "node-0.json").read_text())["failures"] == 1
    assert old.end(143) == (143, "")
    st = json.loads((tmp_path / "restarts" / "node-0.json").read_text())
    assert st["failures"] == 0 and st["attempts"][0]["exit_code"] == 143 and not st["attempts"][0]["counted"]
    assert new.end(137) == (137, "")
    st = json.loads((tmp_path / "restarts" / "node-0.json").read_text())
    assert st["failures"] == 1 and [a["exit_code"] for a in st["attempts"]] == [143, 137]
    # an attempt of an older release revision that ends after `helm upgrade` does not count in the new one
    older = RetryBudget(tmp_path, max_restarts=1, node_rank=0, epoch="1")
    older.begin()
    newer = RetryBudget(tmp_path, max_restarts=1, node_rank=0, epoch="2")
    assert newer.begin() == ""
    older.end(137)
    assert json.loads((tmp_path / "restarts" / "node-0.json").read_text())["failures"] == 0


def test_a_lock_left_by_a_dead_holder_is_taken_over(tmp_path, capsys):
    """A launcher killed inside its update leaves the lock file: a holder provably dead on this machine
    is taken over at once, one on another machine once the file has not changed for the stale time."""
    lock = tmp_path / "restarts" / "node-0.json.lock"
    lock.parent.mkdir()
    dead = Proc([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({**restarts.identity(), "pid": dead.pid, "start": "1", "token": "t1"}))
    t0 = time.monotonic()
    assert RetryBudget(tmp_path, max_restarts=1).begin() == ""
    assert time.monotonic() - t0 < 5 and "is gone" in capsys.readouterr().err
    assert not lock.exists()
    elsewhere = {"host": "other-node", "pid": 1, "boot_id": "another-boot", "pidns": "x", "token": "t2"}
    lock.write_text(json.dumps(elsewhere))
    state_lock = restarts.StateLock(lock, stale_seconds=1.0)
    t0 = time.monotonic()
    with state_lock:
        assert json.loads(lock.read_text())["token"] == state_lock.me["token"]
    assert 1.0 <= time.monotonic() - t0 < 10
    assert "has not changed for 1 s" in capsys.readouterr().err and not lock.exists()


def test_the_watcher_verdict_ends_the_pod_with_its_code(pod, capsys, monkeypatch):
    """The budget-watcher sidecar that cannot start leaves a verdict (a native sidecar that exits would
    only be restarted, and the pod hang in Init): the launcher ends the pod with its code (2), one line,
    before the data verdict and the trainer. A code that would be retried is not taken."""
    monkeypatch.setenv("PRETRAIN_WATCHER_VERDICT", str(pod / "watcher-verdict.json"))
    reason = "--run-dir's budget dir /ckpt/run/budget is not writable by uid 1000 (gid 1000)"
    (pod / "watcher-verdict.json").write_text(json.dumps({"code": 2, "reason": reason}))
    (pod / "verdict.json").write_text(json.dumps({"code": 4, "reason": "no data"}))
    assert attempt(pod, 0) == (2, False)
    line = capsys.readouterr().err.strip()
    assert line == f"launch: the budget watcher cannot run: {reason} -> exit 2 (permanent)"
    assert (pod / "termination-log").read_text().strip() == line
    (pod / "watcher-verdict.json").write_text(json.dumps({"code": 143, "reason": "odd"}))
    assert attempt(pod, 0) == (2, False), "a verdict never asks for a retry"
    (pod / "watcher-verdict.json").unlink()
    assert attempt(pod, 0) == (EXIT_DATA_NOT_READY, False)
