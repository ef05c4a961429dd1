"""The container launcher (`python -m app.launch`): torchrun that keeps the trainer's exit code for
the PyTorchJob ExitCode restart policy and gives the workers their whole save time on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import Proc

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import os, signal, sys, time
code = int(os.environ["CODE"])
rank = int(os.environ["RANK"])
ready = os.environ["READY"]
if code < 0:  # like the trainer: on SIGTERM finish the step, save (SAVE_S seconds), exit 128 + 15
    def stop(*_):
        time.sleep(float(os.environ["SAVE_S"]))
        open(f"{ready}saved{rank}", "w").close()
        sys.exit(int(os.environ.get("STOP_CODE", "143")))
    signal.signal(signal.SIGTERM, stop)
    open(f"{ready}{rank}", "w").close()
    time.sleep(60)
if rank == 1:
    sys.exit(code)
time.sleep(1)
"""


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Path:
    """A work dir holding a fake worker script that exits with a chosen code."""
    path = tmp_path_factory.mktemp("launch")
    (path / "child.py").write_text(CHILD)
    return path


def _launch(launcher: Path, code: int, **env: str) -> Proc:
    env = {
        **os.environ,
        "CODE": str(code),
        "READY": str(launcher / f"r{code}-"),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        **env,
    }
    cmd = [
        sys.executable,
        "-m",
        "app.launch",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "child.py",
    ]
    return Proc(cmd, env=env, cwd=launcher)


@pytest.mark.parametrize("code", [0, 1, 2, 143, 137])
def test_launcher_keeps_the_worker_exit_code(launcher, code):
    """torchrun alone exits 1 for any failure; the ExitCode restart policy needs 2 (permanent) vs 143 (retry)."""
    proc = _launch(launcher, code)
    assert proc.wait(120) == code, proc.output


@pytest.mark.parametrize(("stop_code", "expected"), [(143, 143), (6, 6)], ids=["saved", "volume-full"])
def test_launcher_preempted_saves_then_exits_143(launcher, stop_code, expected):
    """SIGTERM reaches the workers, which get their whole save time (torchrun's own timeout is 1 s here);
    a stop whose save failed for space (the workers' exit 6) is not turned into a retryable 143."""
    ready = launcher / "r-1-"
    for r in (0, 1):  # markers of the other parametrization: each run must leave its own
        Path(f"{ready}{r}").unlink(missing_ok=True)
        Path(f"{ready}saved{r}").unlink(missing_ok=True)
    proc = _launch(launcher, -1, SAVE_S="4", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1", STOP_CODE=str(stop_code))
    proc.wait_for_file(lambda: all(Path(f"{ready}{r}").exists() for r in (0, 1)), timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == expected, proc.output
    out = proc.output
    assert all(Path(f"{ready}saved{r}").exists() for r in (0, 1)), "a worker was killed before its save ended"
    assert "got SIGTERM, passed to workers" in out


RENDEZVOUS_CHILD = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
print(f"rank {dist.get_rank()} met at {os.environ['MASTER_ADDR']}", flush=True)
dist.destroy_process_group()
"""


def test_one_node_rendezvous_is_on_loopback_whatever_the_master_addr(tmp_path):
    """A single-node pod gets PET_MASTER_ADDR = the Master's Service name, and `docker run --network none`
    a hostname that does not resolve: either left the workers retrying for minutes. One node needs no
    name: the launcher rendezvous on 127.0.0.1."""
    from tests.test_budget_inprocess import free_port

    (tmp_path / "child.py").write_text(RENDEZVOUS_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "app.launch", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0"]
    addr = ["--master-addr=no-such-host.invalid", f"--master-port={free_port()}"]  # static, as the chart
    proc = subprocess.run(
        [*cmd, *addr, "child.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the two workers share the pipe: their lines may interleave, so find the records, not the lines
    assert sorted(re.findall(r"rank \d met at [^r\s]+", proc.stdout)) == [
        "rank 0 met at 127.0.0.1",
        "rank 1 met at 127.0.0.1",
    ]
    assert "rendezvous on 127.0.0.1, not no-such-host.invalid" in proc.stderr


def test_sigterm_while_waiting_in_rendezvous_exits_143_at_once(tmp_path):
    """A node of a 2-node job whose Master is not up: the launcher waits in C++ (a TCPStore connect, 900 s
    timeout), where a Python signal handler cannot run. SIGTERM must still end it with 143 at once, not
    after the pod's grace period with SIGKILL (137)."""
    from tests.test_budget_inprocess import free_port

    (tmp_path / "child.py").write_text(RENDEZVOUS_CHILD)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun then says it starts
    env.update(PYTHONPATH=str(REPO), PRETRAIN_RUN_DIR=str(tmp_path / "run"), PET_NODE_RANK="1")
    cmd = [sys.executable, "-m", "app.launch", "--nnodes=2", "--node-rank=1", "--nproc-per-node=2"]
    proc = Proc(
        [*cmd, "--master-addr=127.0.0.1", f"--master-port={free_port()}", "child.py"], env=env, cwd=tmp_path
    )
    proc.wait_for_line("OMP_NUM_THREADS")  # printed just before the rendezvous
    time.sleep(2)
    assert proc.poll() is None, proc.output
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    assert code == 143 and time.monotonic() - t0 < 10, proc.output
    assert "got SIGTERM while waiting in rendezvous -> exit 143" in proc.output
    # the retry budget recorded the attempt (a preemption, not a failure) before the hard exit
    (attempt,) = json.loads((tmp_path / "run" / "restarts" / "node-1.json").read_text())["attempts"]
    assert attempt["exit_code"] == 143 and not attempt["counted"]


WORLD_CHILD = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on node {os.environ['GROUP_RANK']}", flush=True)
dist.destroy_process_group()
"""


def test_the_operators_environment_alone_gives_the_shape_and_the_rendezvous(tmp_path):
    """Kubeflow Trainer v2's torch plugin (like the v1 operator) sets PET_NNODES, PET_NPROC_PER_NODE,
    PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT on the node container: with no torchrun flags,
    two launchers form one 2-node world from them (static rendezvous on the master's address)."""
    from tests.test_budget_inprocess import free_port

    (tmp_path / "child.py").write_text(WORLD_CHILD)
    port, nodes = free_port(), []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PET_NNODES": "2"}
        env.update(PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(node), PET_MASTER_ADDR="127.0.0.1")
        env.update(PET_MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "app.launch", "child.py"]
        nodes.append(Proc(cmd, env=env, cwd=tmp_path, separate_stderr=True))
    codes = [proc.wait(120) for proc in nodes]
    outs = [proc.output for proc in nodes]
    assert codes == [0, 0], outs
    assert "rank 0 of 2 on node 0" in outs[0] and "rank 1 of 2 on node 1" in outs[1], outs


def test_a_lost_peer_wins_only_over_killed_workers():
    """144 when a worker found a lost peer and the others died of a signal (the lost one, or torchrun's
    teardown); a crash beside it keeps its own code, so a bug is not retried as a lost node."""
    from app.launch import workers_code

    assert workers_code([-9, 144]) == 144
    assert workers_code([144, -15, -9]) == 144
    assert workers_code([1, 144]) == 1
    assert workers_code([-9]) == 137
    assert workers_code([0, 2]) == 2


def test_a_restart_at_a_smaller_micro_batch_wins_over_killed_workers():
    """145 (one rank out of memory at an auto micro-batch: the smaller size is recorded) whichever order
    torchrun lists its failures in: the rank that ran out of memory, and the others it left in a
    collective, which torchrun's teardown kills; a crash beside it keeps its own code."""
    from app.launch import workers_code

    assert workers_code([145, -15]) == 145
    assert workers_code([-15, 145]) == 145
    assert workers_code([-15, 145, 145, -9]) == 145
    assert workers_code([1, 145]) == 1
