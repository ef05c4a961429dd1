"""No orphan ranks (#27): whatever kills the launcher (torchrun, or `python -m app.launch`), its ranks end
within seconds. torchrun starts each worker in a session of its own, so a SIGKILL to the launcher's
process group (a terminal's Ctrl-\\, a supervisor outside a container) used to leave the ranks training
on under PID 1, or waiting for ever when it came during start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.launch import children
from tests.conftest import FAST, REPO, cli_env, wait_for_step

LAUNCHERS = {"torchrun": "torch.distributed.run", "app.launch": "app.launch"}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; PID 1 may be slow to reap it


@pytest.mark.parametrize("when", ["training", "start-up"])
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_ranks_end_when_the_launcher_is_killed(tmp_path, launcher, when):
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        LAUNCHERS[launcher],
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "app.train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "100000",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as `setsid torchrun ...`
    )
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 120
        while len(ranks) < 2:  # start-up: the ranks exist, still importing torch
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            ranks = children(proc.pid)
            time.sleep(0.02)
        if when == "training":
            wait_for_step(run, 3, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while any(map(alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in ranks if alive(pid)]
        assert not left, f"ranks {left} outlived their launcher by 30 s"
    finally:
        for pid in children(proc.pid) + ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
