"""Start, watch and stop the project's processes in tests: the trainer, torchrun and the launcher with their
ranks, the budget watcher, the server, prepare.

One way to start them (the real command line, the test environment, output to a log file), to wait for
what they print or write (a line, a file, a port, a training step), to signal them, and to end them
whatever the test does. Two choices matter:

- Output goes to a file, not a pipe. A process that prints more than a pipe holds blocks until someone
  reads it, so a test waiting for a file would hang it; a file never fills, can be read while the process
  runs, and is still there after it ended.
- Every process starts in its own session (process group), so ending it ends its children too (torchrun's
  ranks, the launcher's workers, prepare's tokenizer pool). `Proc.stop` ends the group and every
  descendant with SIGKILL; the `procs` fixture (tests/conftest.py) stops whatever a test started, passed or
  failed, and a `with Procs(...)` block does the same for a module-scoped fixture.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from tests.warm import WARM

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
# Every Proc started and not yet stopped: tests/conftest.py stops the ones a test leaves running.
LIVE: list[Proc] = []
_LOGS: Path | None = None  # where a Proc started without a log path writes its output


def _log_path() -> Path:
    global _LOGS
    if _LOGS is None:
        _LOGS = Path(tempfile.mkdtemp(prefix="pretrain-test-procs-"))
    return Path(tempfile.mkstemp(suffix=".log", dir=_LOGS)[1])


def children(pid: int) -> list[int]:
    """The direct children of `pid` (from /proc; [] once it is gone)."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        found = []
        for task in tasks:
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
        return found
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def state(pid: int) -> str:
    """The process state letter (T: stopped, Z: zombie), "" when gone; T only when every thread is."""
    try:
        states = {
            (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            for task in Path(f"/proc/{pid}/task").iterdir()
        }
    except (OSError, IndexError):
        return ""
    return "T" if states == {"T"} else (states - {"T"}).pop()


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Proc:
    """One started process: its output in `log` (stderr too, unless `separate_stderr`), waits that fail
    with the output's tail when the process exits first or the time is up, signals, and `stop`. A
    `python -m` of the CLI, the trainer or a launcher starts from the worker's warm process
    (tests/warm.py: the same process, without its imports) unless `warm=False`."""

    def __init__(
        self,
        argv: Sequence[str],
        log: Path | None = None,
        *,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
        separate_stderr: bool = False,
        new_session: bool = True,
        warm: bool = True,
    ):
        from tests.conftest import cli_env  # the tests' environment: data cache, unbuffered output, 1 thread

        self.argv = [str(a) for a in argv]
        self.log = Path(log) if log is not None else _log_path()
        self.err_log = self.log.with_suffix(".err") if separate_stderr else None
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = cli_env() if env is None else env
        self.new_session = new_session
        self.owner: Procs | None = None  # the Procs that stops it, if any (else the test's end does)
        if warm and WARM.serves(self.argv, env, cwd):
            self.popen = WARM.popen(self.argv, env, self.log, self.err_log, new_session)
            LIVE.append(self)
            return
        with open(self.log, "wb") as out:
            err = open(self.err_log, "wb") if self.err_log else subprocess.STDOUT  # noqa: SIM115 - closed below
            try:
                self.popen = subprocess.Popen(
                    self.argv,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=new_session,
                )
            finally:
                if self.err_log:
                    err.close()
        LIVE.append(self)

    # ------------------------------------------------------------------ state and output

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def running(self) -> bool:
        return self.popen.poll() is None

    def poll(self) -> int | None:
        return self.popen.poll()

    @property
    def output(self) -> str:
        """What it printed so far (stdout and stderr together, unless stderr is separate)."""
        return self.log.read_text(errors="replace")

    @property
    def errors(self) -> str:
        """What it printed on stderr, when started with `separate_stderr`."""
        assert self.err_log is not None, "started without separate_stderr: stderr is in .output"
        return self.err_log.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        text = self.output + (f"\n[stderr]\n{self.errors}" if self.err_log else "")
        return text[-chars:]

    # ------------------------------------------------------------------ waits

    def wait_until(
        self,
        check: Callable[[], T],
        what: str,
        timeout: float = 120,
        poll: float = 0.02,
        exits_ok: bool = False,
    ) -> T:
        """Poll `check` until it returns something true, and return it. Fails when `timeout` passes, or when
        the process exits first (unless `exits_ok`: then one last check decides)."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if not self.running():
                got = check()  # what it wrote just before it exited
                if got or exits_ok:
                    return got
                raise AssertionError(f"{self.name()} exited {self.returncode} before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g} s\n{self.tail()}")
            time.sleep(poll)

    def wait_for_line(self, pattern: str, timeout: float = 120, stderr: bool = False) -> re.Match:
        """The first match of the regex `pattern` in the output (in stderr with `stderr`)."""
        text = (lambda: self.errors) if stderr else (lambda: self.output)
        return self.wait_until(
            lambda: re.search(pattern, text(), re.M), f"a line matching {pattern!r}", timeout
        )

    def wait_for_file(self, path: Path | Callable[[], object], timeout: float = 120) -> object:
        """`path` exists (or the callable returns something true: a glob's matches, say)."""
        if callable(path):
            return self.wait_until(path, "the files it should write", timeout)
        return self.wait_until(lambda: Path(path).exists() and Path(path), f"{path}", timeout)

    def wait_for_port(self, port: int, timeout: float = 60, host: str = "127.0.0.1") -> None:
        """Something accepts connections on host:port."""

        def accepts() -> bool:
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex((host, port)) == 0

        self.wait_until(accepts, f"a listener on {host}:{port}", timeout, poll=0.1)

    def wait_for_step(self, run_dir: Path, step: int, timeout: float = 120) -> None:
        """The trainer logged train step `step` (or a later one) in run_dir/metrics.jsonl."""
        from tests.conftest import train_rows

        def reached() -> bool:
            rows = train_rows(run_dir)
            return bool(rows) and rows[-1]["step"] >= step

        self.wait_until(reached, f"train step {step} in {run_dir}", timeout)

    def wait_paused(self, marks: Path, timeout: float = 120) -> None:
        """It wrote its mark in `marks` (tests/pause_at.py) and has stopped itself there: the mark comes
        just before the stop, and a SIGCONT sent in between would be lost, leaving it stopped for good."""
        mark = Path(marks) / f"paused-{self.pid}"
        self.wait_until(lambda: mark.exists() and state(self.pid) == "T", f"{mark} and a stop", timeout)

    def wait(self, timeout: float = 120) -> int:
        """Its exit code; fails (and ends it) when it does not exit within `timeout`."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.name()} did not exit within {timeout:g} s:\n{self.tail()}") from None

    def finished(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for the exit and return it as subprocess.run would (stdout, and stderr when separate)."""
        code = self.wait(timeout)
        return subprocess.CompletedProcess(self.argv, code, self.output, self.errors if self.err_log else "")

    def communicate(self, timeout: float = 120) -> tuple[str, str | None]:
        """As subprocess.Popen's: wait for the exit, then (stdout, stderr); stderr is None unless separate."""
        self.wait(timeout)
        return self.output, (self.errors if self.err_log else None)

    # ------------------------------------------------------------------ signals and the end

    def signal(self, sig: int) -> None:
        """`sig` to the process itself (not its children), unless it has ended."""
        if self.running():
            # it can end between the check and the signal (stop's group SIGKILL, reaped by a warm parent)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    send_signal = signal  # as subprocess.Popen names it

    def kill(self) -> None:
        """SIGKILL to the process itself, as Popen.kill (its children are left to what it does on death)."""
        self.signal(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """`sig` to its whole process group (it and the children that did not start their own)."""
        assert self.new_session, "started without a session of its own"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def stop(self) -> None:
        """End it and everything it started, at once (SIGKILL), and reap it. Safe to call again."""
        running = self.running()
        # once it has exited its PID may be another process's, and its children are no longer below it
        tree = descendants(self.pid) if running else []
        if running:
            if self.new_session:
                self.signal_group(signal.SIGKILL)
            self.signal(signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(30)
        with contextlib.suppress(ValueError):
            LIVE.remove(self)

    def name(self) -> str:
        args = self.argv[1:4] if self.argv[0] == sys.executable else self.argv[:3]
        return " ".join(args) + " ..."


class Procs:
    """The processes of one test (or one module fixture): each gets a log in `log_dir`, and `close` (or the
    end of a `with` block) stops every one of them."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.started: list[Proc] = []

    def start(self, argv: Sequence[str], name: str = "proc", **kwargs) -> Proc:
        """`argv` as it is; kwargs as Proc's (env, cwd, separate_stderr, new_session)."""
        log = self.log_dir / f"{name}-{len(self.started)}.log"
        proc = Proc(argv, log, **kwargs)
        proc.owner = self
        self.started.append(proc)
        return proc

    def python(self, *args: str, name: str = "python", **kwargs) -> Proc:
        """`python ARGS` with this interpreter (`-m module ...`, `-c code ...`)."""
        return self.start([sys.executable, *args], name=name, **kwargs)

    def pretrain(self, *args: str, **kwargs) -> Proc:
        """The real `pretrain` CLI: `pretrain train ...`, `pretrain watch ...`, `pretrain serve ...`."""
        return self.python("-m", "app.cli", *args, name=args[0] if args else "pretrain", **kwargs)

    def torchrun(self, *args: str, nproc: int = 2, launcher: str = "torch.distributed.run", **kwargs) -> Proc:
        """The trainer under torchrun (or `launcher="app.launch"`, the container's PID 1) with `nproc`
        local gloo ranks: `args` are the trainer's flags. A module to run instead of app.train, with its
        own arguments, goes first in `args` as `-m MODULE ...`."""
        target = list(args) if args[:1] == ("-m",) else ["-m", "app.train", *args]
        shape = ["--standalone", f"--nproc-per-node={nproc}"]
        return self.python("-m", launcher, *shape, *target, name="torchrun", **kwargs)

    def close(self) -> None:
        for proc in self.started:
            proc.stop()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
