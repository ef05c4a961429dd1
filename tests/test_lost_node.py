"""A lost node: two launchers as two "nodes" on 127.0.0.1 (c10d rendezvous, one gloo process each).
SIGKILL one node's whole process tree (no SIGTERM: an OOM-killed pod) at a step between checkpoints,
during a checkpoint write and during start-up, or SIGSTOP it (a node that vanished silently: power,
network, kernel panic): the other node exits 144 (retryable) within the bound (the time is printed),
naming the lost rank or node and the step; both restart and finish on the weights of an uninterrupted
2-node run, bit for bit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from app.launch import children
from tests.conftest import FAST, REPO, cli_env
from tests.procs import Proc
from tests.test_budget_inprocess import free_port
from tests.test_resume import assert_same_run

STEPS = 20
TRAIN = [*FAST, "--max-steps", str(STEPS), "--set", "checkpoint.every_steps=5"]


def start_node(run: Path, node: int, port: int, pause: str = "", pause_dir: Path | None = None, static=False):
    """One node's launcher. c10d: ranks follow the nodes' addresses (c10d sorts them), node 0 has
    127.0.0.1 and keeps the stores. static: the shape and the Master from PET_* alone, as a Kubeflow
    operator gives them (torchrun's c10d agent polls its rendezvous store, and hangs when that node
    vanishes silently; the static one does not)."""
    env = cli_env(PYTHONPATH=str(REPO))
    if pause:
        env.update(PRETRAIN_TEST_PAUSE=pause, PRETRAIN_TEST_PAUSE_DIR=str(pause_dir))
    if static:
        env.update(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(node), PET_MASTER_PORT=str(port))
        env.update(PET_MASTER_ADDR="127.0.0.1")
        shape = ["--max-restarts=0"]
    else:
        shape = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--max-restarts=0",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--local-addr=127.0.0.{node + 1}",
        ]
    cmd = [sys.executable, "-m", "app.launch", *shape, "-m", "tests.pause_at", "app.train", "--out", str(run)]
    return Proc([*cmd, *TRAIN], run.parent / f"{run.name}-node{node}-{port}.log", env=env)


def listening(port: int) -> bool:
    rows = [
        row.split() for t in ("tcp", "tcp6") for row in Path(f"/proc/net/{t}").read_text().splitlines()[1:]
    ]
    return any(r[1].endswith(f":{port:04X}") and r[3] == "0A" for r in rows)  # 0A: LISTEN


def start_nodes(run: Path, port: int, pause="", lost=0, pause_dir: Path | None = None, static=False) -> list:
    """Node 0 first: once it keeps the rendezvous store (as the Master's pod does), node 1."""
    first = start_node(run, 0, port, pause if lost == 0 else "", pause_dir, static)
    first.wait_until(lambda: listening(port), f"the rendezvous store on port {port}", timeout=60, poll=0.05)
    return [first, start_node(run, 1, port, pause if lost == 1 else "", pause_dir, static)]


def two_nodes(run: Path) -> None:
    """Both nodes to the end, exit 0."""
    finish(start_nodes(run, free_port()))


def finish(nodes: list[Proc]) -> None:
    for proc in nodes:
        assert proc.wait(300) == 0, proc.output


def signal_tree(pid: int, signum: int) -> None:
    """Signal a process and all its descendants: SIGKILL, a node whose kernel closes its sockets (a pod
    OOM-killed, a crash); SIGSTOP, a node that vanished without a word (power, network, kernel panic)."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children(tree[-1]))
    for p in tree:
        # a process of the tree may end on its own meanwhile (a rank that saw its peer go)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signum)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-node run, trained in the background while the first test loses a node: call it
    for the run dir once it is compared."""
    run = tmp_path_factory.mktemp("reference") / "run"
    nodes = start_nodes(run, free_port())

    def finished() -> Path:
        finish(nodes)
        return run

    yield finished
    for proc in nodes:
        proc.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "lost,pause,how,static",
    [
        (
            1,
            "app.trainer.optimization.optimizer:step_unless:8",
            signal.SIGKILL,
            False,
        ),  # between the saves of steps 5, 10
        (0, "app.trainer.checkpoint.writer:write_safetensors:3", signal.SIGKILL, False),  # saving step 10
        (1, "torch.distributed:init_process_group", signal.SIGKILL, False),  # start-up: in the rendezvous
        (
            0,
            "app.trainer.optimization.optimizer:step_unless:8",
            signal.SIGSTOP,
            True,
        ),  # silently, with the store: operators
        (
            0,
            "app.trainer.optimization.optimizer:step_unless:8",
            signal.SIGSTOP,
            False,
        ),  # the same, c10d: torchrun hangs
    ],
    ids=["training", "checkpoint-write", "start-up", "silent", "silent-c10d"],
)
def test_a_lost_node_is_retried_and_the_run_ends_exact(tmp_path, reference, lost, pause, how, static):
    run = tmp_path / "run"
    port = free_port()
    nodes = start_nodes(run, port, pause, lost, tmp_path, static)
    nodes[lost].wait_for_file(lambda: list(tmp_path.glob("paused-*")), timeout=180)
    signal_tree(nodes[lost].pid, how)
    lost_at = time.monotonic()
    survivor = 1 - lost
    code = nodes[survivor].wait(300)
    found = time.monotonic() - lost_at
    signal_tree(nodes[lost].pid, signal.SIGKILL)
    nodes[lost].wait(30)
    out = nodes[survivor].output
    print(f"\n{pause}: node {survivor} exited {code} {found:.1f} s after node {lost} got {how.name}")
    assert code == 144, out
    (line,) = [ln for ln in out.splitlines() if "-> exit 144 (retryable)" in ln]
    assert (f"lost rank {lost} on node {lost}" if lost else "lost node 0") in line and "at step" in line, line
    two_nodes(run)  # the pods restart
    assert_same_run(reference(), run, STEPS)


@pytest.mark.slow
def test_a_killed_local_worker_makes_the_launcher_exit_144(tmp_path):
    """One pod, 2 local workers under the launcher (as the README starts them); `kill -9` one worker's PID
    between the checkpoints of steps 5 and 10: the other finds the lost peer and exits 144, torchrun
    tears down the rest, and the launcher exits 144 (the retryable lost-peer code), not 137 (a plain kill);
    the checkpoint of step 5 is intact for the restart."""
    run = tmp_path / "run"
    env = cli_env(
        PYTHONPATH=str(REPO),
        PRETRAIN_TEST_PAUSE="app.trainer.optimization.optimizer:step_unless:8",
        PRETRAIN_TEST_PAUSE_DIR=str(tmp_path),
    )
    shape = ["--nnodes=1", "--nproc-per-node=2", "--max-restarts=0"]
    cmd = [sys.executable, "-m", "app.launch", *shape, "-m", "tests.pause_at", "app.train", "--out", str(run)]
    launcher = Proc([*cmd, *TRAIN], tmp_path / "launcher.log", env=env)
    # both ranks, before step 8's update
    paused = launcher.wait_until(
        lambda: len(p := list(tmp_path.glob("paused-*"))) >= 2 and p, "2 paused ranks", 180
    )
    by_rank = {int(p.read_text()): int(p.name.split("-")[1]) for p in paused}
    os.kill(by_rank[1], signal.SIGKILL)
    os.kill(by_rank[0], signal.SIGCONT)
    launcher.wait(120)
    out = launcher.output
    assert launcher.returncode == 144, out
    assert "lost rank 1" in out and "-> exit 144" in out.splitlines()[-1], out
    from app.trainer.checkpoint.store import resolve_latest

    assert resolve_latest(run).step == 5


def test_a_store_gone_between_the_check_and_the_connect_is_a_lost_node(procs):
    """A rank first checks that node 0's store listens, then connects to it. When node 0 dies in between,
    the connect is refused until its timeout: the rank then exits 144 (retryable) with a line naming node 0,
    as for any lost node, not 1 with a Python traceback (torch's C++ log of the refused connects comes first)."""
    with socket.create_server(("127.0.0.1", 0)) as store:
        store.settimeout(60)
        env = cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.getsockname()[1]))
        # the store's timeouts, 30 s, shortened in this process only so the test need not wait for them
        code = (
            "import app.trainer.parallel.distributed as d; d.LOST_AFTER_SECONDS = 2.0; "
            "d.PeerWatch(d.DistEnv(rank=1, local_rank=0, world_size=2, local_world_size=1))"
        )
        rank = procs.python("-c", code, env=env)
        store.accept()[0].close()  # answers the check, then is gone
    assert rank.wait(60) == 144, rank.output
    assert "Traceback" not in rank.output, rank.output
    line = rank.output.strip().splitlines()[-1]
    assert line.startswith("rank 1: lost node 0") and line.endswith("-> exit 144 (retryable)"), line
