"""The container launcher (`python -m app.launch`): torchrun that keeps the trainer's exit code for
the PyTorchJob ExitCode restart policy and gives the workers their whole save time on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
        sys.exit(143)
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


def _launch(launcher: Path, code: int, **env: str) -> subprocess.Popen:
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
    return subprocess.Popen(
        cmd, cwd=launcher, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize("code", [0, 1, 2, 143, 137])
def test_launcher_keeps_the_worker_exit_code(launcher, code):
    """torchrun alone exits 1 for any failure; the ExitCode restart policy needs 2 (permanent) vs 143 (retry)."""
    proc = _launch(launcher, code)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out


def test_launcher_preempted_saves_then_exits_143(launcher):
    """SIGTERM reaches the workers, which get their whole save time (torchrun's own timeout is 1 s here)."""
    proc = _launch(launcher, -1, SAVE_S="4", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
    ready = launcher / "r-1-"
    deadline = time.monotonic() + 60
    while not all(Path(f"{ready}{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert all(Path(f"{ready}saved{r}").exists() for r in (0, 1)), "a worker was killed before its save ended"
    assert "got SIGTERM, passed to workers" in out
