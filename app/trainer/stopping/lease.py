"""RUN_DIR/lease.json: only one trainer writes a run dir.

Why: a restarted pod can start while the terminating one still saves on a ReadWriteMany volume (or a
second job may use the same --out), and two writers delete each other's temp dirs, interleave
metrics.jsonl and crash mid-save. flock is not reliable on NFS-type volumes, so the lease is an
O_CREAT|O_EXCL file with a heartbeat, taken by global rank 0 before anything in the run dir is written.

Detail: docs/kubernetes.md, "Running the image" (One trainer per run dir); docs/contracts.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from app.errors import EXIT_LEASE_BUSY as BUSY_EXIT
from app.errors import UserError
from app.files import check_writable_dir, create_exclusive, read_lock_file

LEASE = "lease.json"


class LeaseNotTaken(UserError):
    """The run dir stays with another trainer (exit 142), or a signal came while waiting (128 + N)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); [] when it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split() if stat else []


def _start_ticks(pid: int | str) -> str:
    """A live process's start time (clock ticks after boot; tells it from a reused pid), "" if it is
    gone or a zombie (exited, not yet reaped)."""
    fields = proc_stat(pid)
    return fields[19] if fields and fields[0] not in ("Z", "X") else ""


def running(pid: int | str) -> bool:
    """`pid` is a process that has not exited (a zombie has: exited, not yet reaped)."""
    return bool(_start_ticks(pid))


def identity() -> dict:
    """Who holds the lease: enough to tell, on the same machine, whether that process still lives."""
    pidns = ""
    with contextlib.suppress(OSError):
        pidns = os.readlink("/proc/self/ns/pid")
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _start_ticks("self"),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
    }


def holder_is_dead(lease: dict, me: dict) -> bool:
    """True only when the holder provably ran in this machine's boot and pid namespace and is gone.
    Another pod, node or container (its own pid namespace) is judged by its heartbeat instead."""
    if not me["boot_id"] or not me["pidns"]:
        return False
    if (lease.get("boot_id"), lease.get("pidns")) != (me["boot_id"], me["pidns"]):
        return False
    return _start_ticks(int(lease.get("pid", 0))) != lease.get("start")


class Staleness:
    """Whether another process's lock file (the lease, the launcher's retry state lock) may be taken
    over: its holder provably died on this machine, or the file has not changed for `stale_seconds` on
    the waiter's own clock (holders on other machines are judged by that alone)."""

    def __init__(self, me: dict, stale_seconds: float) -> None:
        self.me, self.stale_seconds = me, stale_seconds
        self.seen: dict | None = None
        self.since = time.monotonic()

    def why(self, held: dict, what: str = "it") -> str:
        """Why `held` (the file's content now) may be taken over, or "" while its holder may live."""
        now = time.monotonic()
        if held != self.seen:
            self.seen, self.since = held, now
        if held and holder_is_dead(held, self.me):
            return f"its process (pid {held.get('pid')} on this machine) is gone"
        if now - self.since >= self.stale_seconds:
            return f"{what} has not changed for {now - self.since:.0f} s"
        return ""


def move_aside(path: Path, stale: dict, tag: str) -> bool:
    """Rename a stale lock file aside (only one taker's rename finds it) and delete it; if what moved is
    not the content judged stale (a new holder's, created in between), put that back. False when gone."""
    aside = path.with_name(f"{path.name}.stale-{tag}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if stale and read_lock_file(aside) != stale:
        with contextlib.suppress(OSError):
            os.link(aside, path)  # fails if yet another holder exists: then it is theirs
    with contextlib.suppress(OSError):
        aside.unlink()
    return True


def describe(lease: dict) -> str:
    age = time.time() - float(lease.get("heartbeat_unix", 0))
    return f"pid {lease.get('pid')} on {lease.get('host')} (heartbeat {age:.0f} s ago)"


class RunLease:
    def __init__(
        self,
        run_dir: Path,
        wait_seconds: float,
        stale_seconds: float,
        log: Callable[[str], None] = print,
        signalled: Callable[[], int] = lambda: 0,
        poll_seconds: float = 0.5,
    ) -> None:
        self.path = Path(run_dir) / LEASE
        self.wait_seconds, self.stale_seconds = wait_seconds, stale_seconds
        self.log, self.signalled, self.poll = log, signalled, poll_seconds
        self.owner = uuid.uuid4().hex
        self.me = identity()
        self.beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _content(self) -> str:
        self.beats += 1
        data = {"owner": self.owner, **self.me, "beat": self.beats, "heartbeat_unix": time.time()}
        return json.dumps(data, sort_keys=True) + "\n"

    def _create(self) -> bool:
        return create_exclusive(self.path, self._content(), durable=True)

    def acquire(self) -> None:
        """Take the lease, waiting for a live holder; LeaseNotTaken when it cannot be had."""
        check_writable_dir(self.path.parent, "--out")
        start, logged = time.monotonic(), -1e9
        staleness = Staleness(self.me, self.stale_seconds)
        while True:
            if signum := self.signalled():
                name = signal.Signals(signum).name
                raise LeaseNotTaken(
                    f"stopped by {name} while waiting for the lease on {self.path.parent}; nothing written",
                    128 + signum,
                )
            if self._create():
                break
            lease = read_lock_file(self.path)
            if lease is None:
                continue  # released between our create and read: try again at once
            why = staleness.why(lease, "its heartbeat")
            age = time.time() - float(lease.get("heartbeat_unix", 0)) if lease else 0.0
            if not why and age >= self.stale_seconds:  # the holder's clock, for a waiter that just came
                why = f"its last heartbeat is {age:.0f} s old"
            if why:
                if move_aside(self.path, lease, self.owner) and self._create():
                    self.log(
                        f"lease: took over the run dir lease of {describe(lease)}: {why} "
                        f"(checkpoint.lease_stale_seconds={self.stale_seconds:g})"
                    )
                    break
                continue
            now = time.monotonic()
            waited = now - start
            holder = describe(lease) if lease else "another trainer"
            if waited >= self.wait_seconds:
                raise LeaseNotTaken(
                    f"run dir {self.path.parent} is still written by {holder} after {waited:.0f} s "
                    f"(checkpoint.lease_wait_seconds); exiting {BUSY_EXIT} so Kubernetes retries later",
                    BUSY_EXIT,
                )
            if now - logged >= 30:
                logged = now
                self.log(
                    f"lease: {self.path.parent} is written by {holder}; only one trainer may write a run "
                    f"dir: waiting up to {self.wait_seconds - waited:.0f} s more for it to finish"
                )
            time.sleep(self.poll)
        self._thread = threading.Thread(target=self._hold, name="run-dir-lease", daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        every = max(self.stale_seconds / 6, 0.2)
        while not self._stop.wait(every):
            lease = read_lock_file(self.path)
            if lease == {}:
                continue  # unreadable for a moment (an NFS hiccup): try at the next beat
            if lease is None or lease.get("owner") != self.owner:
                holder = describe(lease) if lease else "nobody (the file is gone)"
                print(
                    f"lease: lost the run dir lease of {self.path.parent} to {holder} (no heartbeat for "
                    f"{self.stale_seconds:g} s?); exiting {BUSY_EXIT} at once without writing",
                    flush=True,
                )
                os._exit(BUSY_EXIT)
            try:
                with open(self.path, "r+") as f:  # in place: other NFS clients see it on their next open
                    f.write(self._content())
                    f.truncate()
            except OSError as e:
                print(f"lease: heartbeat not written ({e.strerror}); retrying", flush=True)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        lease = read_lock_file(self.path)
        if lease and lease.get("owner") == self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def hold_run_dir(run_dir: Path, checkpoint_cfg, signals, rank0: bool, log=print) -> RunLease | None:
    """The trainer's call at start: global rank 0 takes the lease of `run_dir` (the other ranks write
    nothing before rank 0 reaches the first barrier). `signals`: the trainer's SignalFlag."""
    if not rank0:
        return None
    lease = RunLease(
        run_dir,
        checkpoint_cfg.lease_wait_seconds,
        checkpoint_cfg.lease_stale_seconds,
        log=log,
        signalled=lambda: signals.signum,
    )
    lease.acquire()
    return lease


def release(lease: RunLease | None) -> None:
    if lease is not None:
        lease.release()
