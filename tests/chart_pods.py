"""The chart's rendered trainer-pod steps run for real, their in-pod paths moved under a temp dir: the
wait-for-data initContainer, the budget-watcher sidecar and the launcher (python -m app.launch) with the
environment the chart gives it. Helpers for tests/test_chart*.py (k8s_helpers runs the prepare script).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import k8s_helpers as h

from tests.procs import Proc

WAIT_COMMAND = ["python", "-m", "app.data.wait"]


def master(docs: list) -> dict:
    return h.pod_spec(h.one(docs, "PyTorchJob"), "Master")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a cluster (the API client would look for one) plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    return {**env, "PYTHONPATH": str(h.REPO), **extra}


def wait_step(
    docs: list, root: Path, rtype: str = "Master", extra_args: tuple = (), **env: str
) -> subprocess.CompletedProcess:
    """The rendered wait-for-data container, run for real (paths under root)."""
    c = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), rtype), "wait-for-data", init=True)
    assert c["command"] == WAIT_COMMAND, c["command"]
    cmd = [sys.executable, *c["command"][1:], *(h.local_path(a, root) for a in c["args"]), *extra_args]
    return subprocess.run(cmd, env=clean_env(**env), capture_output=True, text=True, timeout=60, cwd=h.REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_user(cmd: list[str], uid: int | None) -> list[str]:
    """`cmd` as `uid` (root ignores permission bits; the pods run as uid 1000)."""
    if uid is None:
        return cmd
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]


def watcher_sidecar(docs: list, root: Path, port: int, uid: int | None = None) -> Proc:
    """The rendered budget-watcher container (`pretrain watch ...`) started for real, serving on `port`,
    with /etc/pretrain, /ckpt and /run/pretrain under root."""
    c = h.container(master(docs), "budget-watcher", init=True)
    assert c["command"] == ["pretrain"] and c["restartPolicy"] == "Always"
    args = [h.local_path(a.replace("/etc/pretrain", str(root / "etc")), root) for a in c["args"]]
    args[args.index("--metrics-port") + 1] = str(port)
    args[args.index("--kube") + 1] = "off"
    cmd = as_user([sys.executable, "-m", "app.cli", *args], uid)
    return Proc(cmd, env=clean_env(), cwd=h.REPO, separate_stderr=True)


def startup_probe(c: dict, port: int, proc: Proc, timeout: float = 60.0) -> bool:
    """The container's startupProbe (an HTTP GET on its path) against 127.0.0.1:port, polled until it
    answers 200, `timeout` passes, or the process exits (the kubelet would restart it, to the same end)."""
    path = c["startupProbe"]["httpGet"]["path"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


WORKER = "import os, sys; open(os.environ['RAN'], 'a').write('x'); sys.exit(0)\n"


def launcher(docs: list, root: Path, uid: int | None = None) -> subprocess.CompletedProcess:
    """The rendered trainer container's launcher, for real (`python -m app.launch`, one process), with the
    chart's environment (retry budget, verdict files) under root, and a stand-in worker for app.train that
    records that it ran (root/ran)."""
    c = h.container(master(docs), "pytorch")
    assert c["command"] == ["python", "-m", "app.launch"]
    (root / "worker.py").write_text(WORKER)
    env = {k: h.local_path(v, root) for k, v in h.env_map(c).items() if isinstance(v, str)}
    env.update(RAN=str(root / "ran"), PET_NODE_RANK="0", OMP_NUM_THREADS="1")
    env["PRETRAIN_TERMINATION_LOG"] = str(root / "termination-log")
    (root / "termination-log").write_text("")
    os.chmod(root / "termination-log", 0o666)
    cmd = as_user([sys.executable, "-m", "app.launch", "--nnodes=1", "--nproc-per-node=1", "worker.py"], uid)
    return subprocess.run(cmd, env=clean_env(**env), cwd=root, capture_output=True, text=True, timeout=120)


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert not re.search(r"Traceback|File \"", text), text
    return lines[0]
