"""torchrun for containers: the command of every trainer pod (PID 1).

    python -m app.launch <torchrun arguments> -m app.train <trainer arguments>

(or any other module: the chart's benchmark job runs `-m app.tools.bench`; the exit code is its own).

Plain torchrun as a pod's command breaks the stop protocol twice:
1. On SIGTERM it forwards the signal to its workers but SIGKILLs them 30 s later (before torch 2.12
   the 30 s cannot be changed), which cuts a large checkpoint short.
2. It exits 1 whenever a worker fails, whatever the worker's code was, while the PyTorchJob
   `ExitCode` restart policy needs the real one: 128 + signal (preempted: retried) versus 1-127
   (permanent; 2 = bad config).

This launcher runs torchrun's own `run()` in-process and changes only those two things:
- SIGTERM/SIGINT are passed to the worker processes and recorded; torchrun keeps monitoring them,
  so the workers finish the step, agree, checkpoint and exit in their own time (the pod's
  terminationGracePeriodSeconds is the only deadline). A signal before the workers exist aborts
  the launch as torchrun would.
- The exit code: 0 when every worker exited 0; 128 + signal when this launcher was signalled and a
  worker did not exit 0; else the code of the first worker that failed, the cause (143 when it stopped
  because a peer on another node was preempted, 2 bad config, 1 crash; killed by signal S: 128 + S).
  torchrun records failures in the order it saw them; those it terminates afterwards are ignored.

And two things a container needs:
- One node rendezvous on 127.0.0.1. torchrun otherwise hands the workers this machine's FQDN (c10d,
  the default for one node) or --master-addr / $PET_MASTER_ADDR (static: the Master's Service name),
  and where that does not resolve (`docker run --network none`, a pod whose Service has no DNS yet)
  the workers retry for 300 s and the agent for 900 s. Pass --local-addr to choose otherwise.
- A SIGTERM while the launcher waits in C++ (a TCPStore connect to a Master that is not up yet) exits
  128 + 15 within a second. Python runs signal handlers only between bytecodes, so there the handler
  above would wait for the connect to time out (900 s) and the pod be SIGKILLed after its grace period.
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
from torch.distributed.run import parse_args, parse_min_max_nnodes, run

LOOPBACK = "127.0.0.1"
received: list = []
handled = [0]  # signals the Python handler has run for (the watchdog compares)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def children(pid: int) -> list:
    """Live direct children of `pid` (Linux /proc): torchrun's worker processes."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


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


hard_exit_hooks: list = []  # run, in order, before the os._exit of a signal caught in rendezvous


def watch_signals_in_c(grace: float = 1.0) -> None:
    """Exit 128 + N on SIGTERM/SIGINT even while the main thread is stuck in C++. Python's C-level
    handler writes each signal number to the wakeup fd at once; this thread reads it, and if the
    Python handler has not run `grace` seconds later, acts for it: no workers yet -> exit now (nothing
    to save); workers -> pass the signal on, as the handler would."""
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
                    code = 128 + signum
                    _log(
                        f"launch: got {signal.Signals(signum).name} while waiting in rendezvous "
                        f"-> exit {code}"
                    )
                    for hook in hard_exit_hooks:  # e.g. the retry budget records the attempt
                        code = hook(code)
                    os._exit(code)
                handled[0] = seen
                pass_on(signum, workers)

    threading.Thread(target=loop, name="launch-signals", daemon=True).start()


def failure_exit_code(codes: list) -> int:
    """The first failed worker's code (torchrun lists the cause first) as a shell reports it (negative =
    killed by that signal); 1 when none is listed."""
    code = next((c for c in codes if c != 0), 1)
    return 128 - code if code < 0 else code


def main(argv: list) -> int:
    # torchrun installs `_terminate_process_handler` (looked up at call time) when it starts workers.
    elastic_api._terminate_process_handler = forward
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    watch_signals_in_c()
    args = parse_args(argv)
    rendezvous_locally(args)
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        code = 128 + received[0] if received else failure_exit_code(codes)
        _log(f"launch: worker exit codes {codes} -> exit {code}")
        return code
    except elastic_api.SignalException as e:
        code = 128 + int(e.sigval)
        _log(f"launch: stopped by {signal.Signals(e.sigval).name} -> exit {code}")
        return code
    return 0  # every worker exited 0, even if a signal came: the run is done, nothing to retry


if __name__ == "__main__":
    from app.restarts import gated  # retry budget + data verdict (app/restarts.py)

    sys.exit(gated(main, sys.argv[1:], hard_exit_hooks))
