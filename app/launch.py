"""torchrun for containers: the command of every trainer pod (PID 1).

    python -m app.launch <torchrun arguments> -m app.train <trainer arguments>

Why: plain torchrun breaks the stop protocol and the PyTorchJob `ExitCode` policy in a pod: it SIGKILLs
its workers 30 s after a SIGTERM (cutting a checkpoint short) and exits 1 for any failure. This runs
torchrun's own `run()` in-process, passes signals to the workers, returns the trainer's exit code, and
covers what a container lacks (one-node rendezvous on 127.0.0.1, a SIGTERM during a C++ wait, a hung agent).

Detail: docs/kubernetes.md, "What runs in the pods", "Running the image" (Hostnames) and "A lost node".
"""

import argparse
import contextlib
import os
import signal
import sys
import threading
import time

import torch.distributed.elastic.multiprocessing.api as elastic_api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.run import parse_args, parse_min_max_nnodes, run

from app.errors import EXIT_OUT_OF_SPACE, EXIT_PEER_LOST, EXIT_SMALLER_BATCH
from app.errors import print_stderr as _log
from app.trainer.stopping.lease import proc_stat

LOOPBACK = "127.0.0.1"
received: list = []
handled = [0]  # signals the Python handler has run for (the watchdog compares)


def children(pid: int, state: str = "") -> list:
    """Direct children of `pid` (Linux /proc): torchrun's worker processes; with `state`, those in it."""
    stats = {int(entry): proc_stat(entry) for entry in filter(str.isdigit, os.listdir("/proc"))}
    return [child for child, f in stats.items() if f and int(f[1]) == pid and state in ("", f[0])]


def forward(signum, _frame) -> None:
    """Signal handler in place of torchrun's (which raises and later SIGKILLs the workers)."""
    if signum in (signal.SIGTERM, signal.SIGINT):
        handled[0] += 1
    workers = children(os.getpid())
    if not workers and not received:
        raise elastic_api.SignalException(f"launch: got signal {signum}", sigval=signal.Signals(signum))
    if not received:
        _log(f"launch: got {signal.Signals(signum).name}, passed to workers {workers}")
    pass_on(signum, workers)


def pass_on(signum: int, workers: list) -> None:
    received.append(signum)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def rendezvous_locally(args: argparse.Namespace) -> None:
    """One node: every process is on this machine, so rendezvous on loopback (see the module doc)."""
    if parse_min_max_nnodes(args.nnodes)[1] != 1:
        return
    if not args.local_addr:
        args.local_addr = LOOPBACK  # the address c10d hands the workers as MASTER_ADDR
    if args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_addr != LOOPBACK:
        _log(f"launch: one node: rendezvous on {LOOPBACK}, not {args.master_addr}")
        args.master_addr = LOOPBACK


def shell_code(code: int) -> int:
    """A process's exit code as a shell reports it: 128 + N when killed by signal N (Python says -N)."""
    return 128 - code if code < 0 else code


def workers_code(codes: list) -> int:
    """The launcher's code for its failed workers: a code workers chose so that the run is retried, when
    every other worker was killed by a signal (the lost one itself, or torchrun's teardown of the rest),
    whatever order torchrun lists them in: 145 (a rank ran out of memory at an auto micro-batch, the
    smaller one is recorded), else 144 (a lost peer), so the operators retry it as that, not as a plain
    kill; else the first failure's code (a crash beside them keeps its own: a bug is not retried)."""
    chosen = [c for c in (EXIT_SMALLER_BATCH, EXIT_PEER_LOST) if c in codes]
    if chosen and all(c in chosen or c < 0 for c in codes):
        return chosen[0]
    return shell_code(next((c for c in codes if c), 1))


hard_exit_hooks: list = []  # run, in order, before an os._exit (a signal caught in rendezvous, a hang)


def hard_exit(code: int, why: str) -> None:
    _log(f"launch: {why} -> exit {code}")
    for hook in hard_exit_hooks:  # e.g. the retry budget records the attempt
        code = hook(code)
    os._exit(code)


def exit_if_torchrun_hangs(after: float = 10.0) -> None:
    """A worker unreaped for `after` s (torchrun's c10d agent stuck, see the module doc): exit with its code."""

    def loop() -> None:
        dead_since: dict = {}
        while True:
            time.sleep(1.0)
            for pid in children(os.getpid(), "Z"):
                if time.monotonic() - dead_since.setdefault(pid, time.monotonic()) >= after:
                    with contextlib.suppress(ChildProcessError):  # torchrun reaped it after all
                        code = shell_code(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
                        hard_exit(code, f"torchrun hung {after:.0f} s after a worker ended (a node lost?)")

    threading.Thread(target=loop, name="launch-reaper", daemon=True).start()


def watch_signals_in_c(grace: float = 1.0) -> None:
    """Exit 128 + N on SIGTERM/SIGINT even while the main thread is stuck in C++: this thread reads the wakeup
    fd and, if the Python handler has not run `grace` s later, acts for it (no workers: exit; else pass on)."""
    r, w = os.pipe()  # not inherited by the workers (close-on-exec)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def loop() -> None:
        seen = 0
        while True:
            for signum in os.read(r, 64):
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue
                seen += 1
                deadline = time.monotonic() + grace
                while handled[0] < seen and time.monotonic() < deadline:
                    time.sleep(0.05)
                if handled[0] >= seen:
                    continue
                workers = children(os.getpid())
                if not workers:
                    hard_exit(128 + signum, f"got {signal.Signals(signum).name} while waiting in rendezvous")
                handled[0] = seen
                pass_on(signum, workers)

    threading.Thread(target=loop, name="launch-signals", daemon=True).start()


def main(argv: list) -> int:
    # torchrun installs `_terminate_process_handler` (looked up at call time) when it starts workers.
    elastic_api._terminate_process_handler = forward
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    watch_signals_in_c()
    exit_if_torchrun_hangs()
    os.environ["PRETRAIN_LAUNCHER_PID"] = str(os.getpid())  # a worker that outlives this pid ends itself
    args = parse_args(argv)
    rendezvous_locally(args)
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        # a signal asked for a stop, unless the stop's own save failed for space: that must not be retried
        code = 128 + received[0] if received and EXIT_OUT_OF_SPACE not in codes else workers_code(codes)
        _log(f"launch: worker exit codes {codes} -> exit {code}")
        return code
    except RendezvousConnectionError as e:  # c10d: the node that kept the rendezvous store is gone
        code = 128 + received[0] if received else EXIT_PEER_LOST
        _log(f"launch: lost the node that kept the rendezvous store ({e.__cause__ or e}) -> exit {code}")
        return code
    except elastic_api.SignalException as e:
        code = 128 + int(e.sigval)
        _log(f"launch: stopped by {signal.Signals(e.sigval).name} -> exit {code}")
        return code
    return 0  # every worker exited 0, even if a signal came: the run is done, nothing to retry


if __name__ == "__main__":
    from app.restarts import gated  # retry budget + data verdict (app/restarts.py)

    sys.exit(gated(main, sys.argv[1:], hard_exit_hooks))
