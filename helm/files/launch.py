"""torchrun that keeps the trainer's exit code (mounted at /etc/pretrain/launch.py by the chart).

    python /etc/pretrain/launch.py <torchrun arguments> -m app.train <trainer arguments>

torchrun itself exits 1 whenever a worker fails, whatever the worker's code was. The PyTorchJob
`ExitCode` restart policy needs the real code: 128 + signal (preempted, retried) versus 1-127
(permanent; 2 = bad config). This wrapper runs torchrun's own `run()` and maps the result:

- every worker exited 0                         -> 0
- this launcher got SIGTERM/SIGINT (preemption) -> 128 + signal (retried); the workers got the
  signal from torchrun and had its shutdown timeout to checkpoint
- a worker failed                               -> the code of the first failed worker, the cause
  (143 when it stopped for a peer's preemption, 2 bad config, 1 crash; killed by signal S -> 128 + S).
  torchrun records failures in the order it saw them; the workers it then terminates itself
  come after the cause and are ignored.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def worker_exit_code(exitcode: int) -> int:
    """A worker's exit code as a shell would report it (negative = killed by that signal)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def failure_exit_code(codes: list) -> int:
    """The exit code for failures listed in the order torchrun recorded them (the cause first)."""
    first = [worker_exit_code(c) for c in codes if c != 0][:1]
    return first[0] if first else 1


def _raise_signal(signum, _frame):
    # Before torchrun installs its own handlers (during rendezvous) a SIGTERM to PID 1 would be ignored.
    raise SignalException(f"launcher got signal {signum}", sigval=signal.Signals(signum))


def main(argv: list) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_signal)
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        code = failure_exit_code(codes)
        print(f"launch: worker exit codes {codes} -> exit {code}", file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        code = 128 + int(e.sigval)
        print(f"launch: got {signal.Signals(e.sigval).name} -> exit {code}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
