"""`python -m app.launch <torchrun args>`: torchrun under a supervisor that keeps the stop protocol.

Why not plain torchrun as the container's command: on SIGTERM torchrun gives its workers a fixed
30 s before SIGKILL (a large checkpoint can take longer), then exits 1 with a traceback, which the
PyTorchJob ExitCode restart policy treats as a permanent failure. This supervisor runs as PID 1
instead: on SIGTERM/SIGINT it signals the training processes directly (they finish the step, agree,
checkpoint and exit; Kubernetes' terminationGracePeriodSeconds is the only deadline), waits for
torchrun, and exits 128 + signal number so the operator restarts the job. Otherwise it exits with
torchrun's own code (0 done; 1 a worker failed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All live descendants of `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv])
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        # The workers, not torchrun: torchrun would SIGKILL them 30 s later.
        for pid in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    if received:
        return 128 + received[0]
    return code


if __name__ == "__main__":
    sys.exit(main())
