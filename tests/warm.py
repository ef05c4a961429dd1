"""Run `python -m MODULE ARGS` (the CLI, the trainer, a launcher) as a real process that starts with the
project already imported.

Importing torch, dynamo (torch.optim imports it on an optimizer's first use) and DTensor costs a process
about 6 CPU-seconds on this machine, more than a test's whole training run: most of what the suite
spent on its many short runs was imports. Each pytest worker therefore starts one warm process
(`python -m tests.warm SOCKET`) that imports the project and then only forks. For a run, the fork forks
again: the grandchild is the run (its own PID, session when asked, environment, working directory,
output files and exit status; it runs the module as `python -m` does, from `__main__` to the
interpreter's exit: non-daemon threads joined, atexit handlers run), and the child waits for it and
writes its exit status. Nothing is shared with the test's process or between runs: each is a copy of
the warm process taken before any tensor work.

A launcher started warm (torchrun, app.launch) forks its ranks from itself in place of torch's Popen,
so a rank skips the imports too. It is what Popen would have made: the launcher's child, in a session of
its own, with the launcher's stdout and stderr, unbuffered (`python -u`), the environment torchrun gave
it, caught signals back at their defaults, and none of the launcher's descriptors (its rendezvous store
must close when the launcher dies). torchrun polls, signals and reaps it as it would a Popen.

One difference shows from outside: /proc/PID/environ is the warm process's environment (a fork does no
exec); the run's os.environ, and its children's, is the one given. What a fork cannot give is a fresh
interpreter, so a run starts as a plain subprocess when it needs one: a working directory other than
the repository, or an environment that differs in what is read at import time (TORCH*, PYTORCH*,
PYTHON*, OMP*, MKL*, KMP*, CUDA*, LD_*). A test of what happens during the imports, or to the
interpreter itself, starts its process with `Proc(..., warm=False)` (tests/procs.py).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import importlib.util
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path

import app

REPO = Path(__file__).resolve().parents[1]
# environment variables that modules read when they are imported: a run that sets them differently gets
# a fresh interpreter
IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "PYTHON", "OMP_", "MKL_", "KMP_", "CUDA", "LD_")
# what the CLI's commands import, imported once in the warm process
WARM_MODULES = [
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "app.cli",
    "app.train",
    "app.tools.bench",
    "app.tools.sample",
    "app.tools.export",
]
# the modules a warm process runs as `python -m MODULE` (tests.pause_at wraps a function where the
# project's modules, all imported here, hold it)
WARM_RUNS = {"app.cli", "app.train", "app.launch", "torch.distributed.run", "tests.pause_at"}


# launchers whose ranks are forked from the launcher itself, and the modules those ranks may run
AGENTS = {"app.launch", "torch.distributed.run"}
WARM_RANKS = {"app.train", "app.cli", "tests.pause_at"}
# what torch's elastic agent adds to a rank's environment, read when a rank starts, not at import
ELASTIC_ENV = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# under those prefixes but read when used, not at import: inductor's cache dir, which torch also writes
# into the environment of a process that compiles (a pytest worker's in-process tests do)
CALL_TIME_ENV = ("TORCHINDUCTOR_CACHE_DIR",)
# the import-time environment the warm process was started with
SERVED_ENV: dict[str, str] = {}


def _import_env(env: dict[str, str], ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """What of `env` is read at import time, less the names in `ignore`. PYTHONPATH=REPO adds nothing:
    `python -m` from the repository already has it first on sys.path."""
    ignore = (*ignore, *CALL_TIME_ENV)
    found = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and not k.startswith(ignore)}
    if found.get("PYTHONPATH") == str(REPO):
        del found["PYTHONPATH"]
    return found


# ---- the warm process ------------------------------------------------------------------------------


def _become(request: dict) -> None:
    """In the grandchild: become `python -m MODULE ARGS` and never return."""
    if request["new_session"]:
        os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out
    if request["stderr"]:
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    # the handlers a fresh interpreter starts with (the warm process ignores SIGCHLD)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["module"] in AGENTS:
        _fork_ranks()
    _run_module(request["module"], request["args"])


def _run_module(module: str, args: list[str]) -> None:
    """Run `python -m MODULE ARGS` from `__main__` through the interpreter's exit; never return."""
    # what a fresh interpreter reads when it imports the project: the process that started it
    app.STARTED_BY = os.getppid()
    code = 0
    try:
        sys.argv = [importlib.util.find_spec(module).origin, *args]
        # as under `python -m`, the module runs as __main__ only (an import of it loads a second copy)
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # what the interpreter does on its way out: join non-daemon threads, run atexit handlers, flush
    with contextlib.suppress(BaseException):
        threading._shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code & 0xFF)


# ---- ranks forked by a warm launcher -----------------------------------------------------------------


class _Started:
    """What tests/procs.py's Proc and torch's elastic agent use of a subprocess.Popen, for a process this
    module started: `poll` says how it learns the exit code."""

    def __init__(self, args, pid: int):
        self.args = args
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


class ForkedRank(_Started):
    """A rank a warm launcher forked: its own child, so it reaps it."""

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _rank_module(args: tuple, env: dict[str, str]) -> str | None:
    """The module of `python -u -m MODULE ...` if this launcher can fork it warm, else None."""
    runs_warm = (
        len(args) >= 4
        and args[0] == sys.executable
        and args[1:3] == ("-u", "-m")
        and args[3] in WARM_RANKS
        and _import_env(env, ignore=ELASTIC_ENV) == _import_env(SERVED_ENV, ignore=ELASTIC_ENV)
    )
    return args[3] if runs_warm else None


def _neutralize_inherited_fds() -> None:
    """What exec does to the launcher's close-on-exec descriptors, and Popen's close_fds to the rest:
    a rank must not keep the launcher's store socket open (a peer would find it listening after the
    launcher died). /dev/null takes each number's place, so no object closes a number the rank reuses."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != null:
            with contextlib.suppress(OSError):
                os.dup2(null, fd, inheritable=False)
    os.close(null)


def _become_rank(stdout: int, stderr: int, env: dict[str, str], started: int) -> None:
    """In the forked rank: what Popen and a fresh `python -u` would have set up. `started` is written
    once the rank leads its session, as Popen returns only then: torchrun may signal the group at once."""
    os.setsid()
    os.write(started, b"1")
    os.close(started)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    _neutralize_inherited_fds()
    os.environ.clear()
    os.environ.update(env)
    # exec resets caught signals to their defaults and keeps ignored ones ignored; Python then sets SIGINT
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.disable()
    # the launcher's finalizers are its own (a temporary directory it made); the rank keeps the atexit
    # handlers that imports registered, as a fresh interpreter has them
    for finalizer in list(weakref.finalize._registry):
        finalizer.detach()
    # -u: unbuffered binary layer, text layer written through
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors, write_through=True
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fork_ranks() -> None:
    """Make torch's elastic agent fork its ranks from itself: the launcher is already warm, and a rank
    would otherwise pay the imports again. A rank is the agent's child as under Popen (its own session,
    the same stdout and stderr, the launcher's death reaches it), so the agent polls, signals and reaps it
    as it would a Popen. A rank this cannot serve (another module, another import-time environment)
    starts with Popen."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    popen = subprocess_handler.SubprocessHandler._popen

    def _popen(handler, args: tuple, env: dict[str, str]):
        module = _rank_module(args, env)
        if module is None:
            return popen(handler, args, env)
        stdout = handler._stdout.fileno() if handler._stdout else 1
        stderr = handler._stderr.fileno() if handler._stderr else 2
        # flushed before the fork, so no buffered output is written twice
        sys.stdout.flush()
        sys.stderr.flush()
        started, started_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(started)
            try:
                _become_rank(stdout, stderr, env, started_w)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            _run_module(module, list(args[4:]))
        os.close(started_w)
        os.read(started, 1)  # b"" if it died first: poll() then reports that
        os.close(started)
        return ForkedRank(args, pid)

    subprocess_handler.SubprocessHandler._popen = _popen


def _start_one(conn: socket.socket, listener: socket.socket) -> None:
    """In the child: start the run, tell the client its PID, wait for it, write its exit status."""
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request = json.loads(conn.makefile("r").readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become(request)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    conn.close()
    _, status = os.waitpid(pid, 0)
    status_path = Path(request["status"])
    status_path.with_suffix(".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
    status_path.with_suffix(".tmp").rename(status_path)
    os._exit(0)


def serve(path: str) -> None:
    SERVED_ENV.update(_import_env(os.environ))
    for name in WARM_MODULES:
        importlib.import_module(name)
    # children that wrote their run's exit status are reaped by the kernel
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once the imports are done
    while True:
        conn, _ = listener.accept()
        # flushed before the fork, so no buffered output is written twice
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            _start_one(conn, listener)
        conn.close()


# ---- the client (in the test's process) ------------------------------------------------------------


class WarmPopen(_Started):
    """A run the warm process started: its child reaps it and writes the exit code to `status`."""

    def __init__(self, args: list[str], pid: int, status: Path):
        super().__init__(args, pid)
        self.status = status

    def poll(self) -> int | None:
        if self.returncode is None and self.status.exists():
            self.returncode = int(self.status.read_text())
        return self.returncode


class Warm:
    """One warm process per pytest worker, started on first use and ended with the session."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        # what the warm process starts with, and so what a run must read at import time to be served: the
        # tests' default environment (conftest sets it to cli_env()), not whichever run comes first
        self.env: dict[str, str] = {}
        self.dir = ""
        self.lock = threading.Lock()
        self.runs = 0

    def _socket(self) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.dir = tempfile.mkdtemp(prefix="pretrain-warm-")
                with open(Path(self.dir) / "warm.log", "wb") as log:
                    self.proc = subprocess.Popen(
                        [sys.executable, "-m", "tests.warm", str(Path(self.dir) / "sock")],
                        cwd=REPO,
                        env=self.env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
        sock = Path(self.dir) / "sock"
        deadline = time.monotonic() + 300
        while not sock.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the warm process died: {(Path(self.dir) / 'warm.log').read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError("the warm process did not start in 300 s")
            time.sleep(0.05)
        return str(sock)

    def serves(self, argv: list[str], env: dict[str, str], cwd: Path) -> bool:
        """Whether `argv` can start warm: `python -m MODULE ...` of a module the warm process runs, from the
        repository, with what is read at import time as the warm process has it."""
        return (
            len(argv) >= 3
            and argv[0] == sys.executable
            and argv[1] == "-m"
            and argv[2] in WARM_RUNS
            and Path(cwd).resolve() == REPO
            and _import_env(env) == _import_env(self.env)
        )

    def popen(
        self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path | None, new_session: bool
    ) -> WarmPopen:
        sock_path = self._socket()
        with self.lock:
            self.runs += 1
            status = Path(self.dir) / f"status-{self.runs}"
        request = {
            "module": argv[2],
            "args": argv[3:],
            "env": env,
            "cwd": str(REPO),
            "stdout": str(stdout),
            "stderr": str(stderr) if stderr else "",
            "new_session": new_session,
            "status": str(status),
        }
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(sock_path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            line = sock.makefile("r").readline()
        if not line:
            raise RuntimeError(f"the warm process did not start {argv}")
        return WarmPopen(argv, json.loads(line)["pid"], status)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


WARM = Warm()


if __name__ == "__main__":
    serve(sys.argv[1])
