"""Run `python -m app.cli ARGS` as a real process that starts with the project already imported.

Importing torch, dynamo (torch.optim imports it on an optimizer's first use) and DTensor costs a process
about 6 CPU-seconds on this machine, more than a test's whole training run: most of what the suite
spends on its many short CLI runs was imports. Each pytest worker therefore starts one warm process
(`python -m tests.warm SOCKET`) that imports the project and then only forks. For a run, the fork forks
again: the grandchild is the run (its own PID, environment, working directory, output files and exit
status; it runs app.cli as `python -m app.cli` does, from `__main__` to the interpreter's exit: non-daemon
threads joined, atexit handlers run), the child waits for it and reports its exit status. Nothing is
shared with the test's process or between runs: each is a copy of the warm process taken before any
tensor work.

One difference shows from outside: /proc/PID/environ is the warm process's environment (a fork does no
exec); the run's os.environ, and its children's, is the one given. What a fork cannot give is a fresh
interpreter, so `run` falls back to a plain subprocess when a run
needs one: a working directory other than the repository, or an environment that differs in what is
read at import time (TORCH*, PYTORCH*, PYTHON*, OMP*, MKL*, KMP*, CUDA*, LD_*). Tests of what happens
during imports or to the interpreter itself start real processes (tests/procs.py) and never come here.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
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
from pathlib import Path

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
# the modules a warm process runs as `python -m MODULE` (tests.pause_at is not one: it wraps a function
# before the code under test imports it, which only a fresh interpreter allows)
WARM_RUNS = {"app.cli", "app.train", "app.launch", "torch.distributed.run"}


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


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
    code = 0
    try:
        module = request["module"]
        sys.argv = [importlib.util.find_spec(module).origin, *request["args"]]
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


class WarmPopen:
    """What tests/procs.py's Proc uses of a subprocess.Popen, for a process the warm process started."""

    def __init__(self, args: list[str], pid: int, status: Path):
        self.args = args
        self.pid = pid
        self.status = status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.status.exists():
            self.returncode = int(self.status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


class Warm:
    """One warm process per pytest worker, started on first use and ended with the session."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.dir = ""
        self.lock = threading.Lock()
        self.runs = 0

    def _socket(self, env: dict[str, str]) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.dir = tempfile.mkdtemp(prefix="pretrain-warm-")
                self.env = dict(env)
                with open(Path(self.dir) / "warm.log", "wb") as log:
                    self.proc = subprocess.Popen(
                        [sys.executable, "-m", "tests.warm", str(Path(self.dir) / "sock")],
                        cwd=REPO,
                        env=env,
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
            and (self.proc is None or _import_env(env) == _import_env(self.env))
        )

    def popen(
        self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path | None, new_session: bool
    ) -> WarmPopen:
        sock_path = self._socket(env)
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

    def run(self, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """`python -m app.cli ARGS` from the repository, as subprocess.run(capture_output=True, text=True)."""
        cmd = [sys.executable, "-m", "app.cli", *args]
        if not self.serves(cmd, env, REPO):
            return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        with tempfile.TemporaryDirectory(prefix="pretrain-run-") as out:
            stdout, stderr = Path(out) / "stdout", Path(out) / "stderr"
            proc = self.popen(cmd, env, stdout, stderr, new_session=False)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                raise
            read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
            return subprocess.CompletedProcess(cmd, code, read(stdout), read(stderr))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


WARM = Warm()


if __name__ == "__main__":
    serve(sys.argv[1])
