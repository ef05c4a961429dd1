"""No orphan ranks: whatever kills the launcher (torchrun, or `python -m app.launch`), its ranks end
within seconds. torchrun starts each worker in a session of its own, so a SIGKILL to the launcher's
process group (a terminal's Ctrl-\\, a supervisor outside a container) used to leave the ranks training
on under PID 1, or waiting for ever when it came during start-up."""

from __future__ import annotations

import os
import signal
import time

import pytest

from app.launch import children
from tests.conftest import FAST, cli_env
from tests.procs import alive

LAUNCHERS = {"torchrun": "torch.distributed.run", "app.launch": "app.launch"}


@pytest.mark.parametrize("when", ["training", "start-up"])
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_ranks_end_when_the_launcher_is_killed(tmp_path, procs, launcher, when):
    run = tmp_path / "run"
    # start-up: each rank stops itself just before it joins the run (tests/pause_at.py), so the launcher
    # is gone before the rank could tie its own end to it; it must find that out on its own. It must not
    # count on the store being gone too: on every node but the first, the store is another node's.
    pause = "app.trainer.parallel.distributed:init_distributed" if when == "start-up" else ""
    env = cli_env(PRETRAIN_TEST_PAUSE=pause, PRETRAIN_TEST_PAUSE_DIR=str(tmp_path))
    trainer = ["-m", "tests.pause_at", "app.train", "--out", str(run), *FAST, "--max-steps", "100000"]
    # in a process group of its own, as `setsid torchrun ...`
    proc = procs.torchrun(*trainer, env=env, launcher=LAUNCHERS[launcher])
    ranks = proc.wait_until(lambda: len(found := children(proc.pid)) >= 2 and found, "2 ranks")
    try:
        if when == "training":
            proc.wait_for_step(run, 3)
        else:
            proc.wait_until(lambda: len(list(tmp_path.glob("paused-*"))) == 2, "both ranks paused")
        proc.signal_group(signal.SIGKILL)
        proc.wait(30)
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while any(map(alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in ranks if alive(pid)]
        assert not left, f"ranks {left} outlived their launcher by 30 s"
        if when == "start-up":
            ended = [line for line in proc.output.splitlines() if "its launcher (pid" in line]
            assert len(ended) == 2, proc.output
            assert all(line.endswith(") ended -> exit 144 (retryable)") for line in ended), proc.output
    finally:
        for pid in filter(alive, ranks):  # no longer the launcher's children: end them here
            os.kill(pid, signal.SIGKILL)
