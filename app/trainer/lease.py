"""RUN_DIR/lease.json: only one trainer writes a run dir.

Two trainers meet on one run dir when a restarted pod starts while the terminating one still saves its
checkpoint on a ReadWriteMany volume, or when someone starts a second job on the same --out. Both
writing means deleted temp dirs, interleaved metrics.jsonl and a crash mid-save. flock is not reliable
on NFS-type volumes (and is dropped across server failovers), so the lease is a file with a heartbeat:

- take: create lease.json with O_CREAT|O_EXCL (atomic on local filesystems and NFSv3+); global rank 0
  holds it for the whole job, before anything in the run dir is written;
- hold: a thread rewrites the heartbeat every `stale_seconds / 6` (in place, so another NFS client
  sees it on its next open); a holder that finds the lease taken from it exits at once (code 142)
  without writing another byte;
- wait: a second trainer polls, logging who holds it, for up to `checkpoint.lease_wait_seconds`, then
  exits 142 (>= 128, so the PyTorchJob ExitCode policy retries it later); SIGTERM while waiting exits
  128 + 15 at once;
- take over: a lease whose holder is gone (its heartbeat has not changed for
  `checkpoint.lease_stale_seconds` as seen by the waiter's own clock, or is older than that by the
  wall clock, or its process is dead on this same machine) is renamed aside (one renamer wins) and
  replaced, with a log line;
- release: the holder deletes it on exit.

The budget ledger keeps its own lock (app/budget/ledger.py): a sidecar watcher charges a run dir that
no trainer holds at that moment.
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

from app.errors import UserError
from app.files import check_writable_dir, create_exclusive, read_lock_file

LEASE = "lease.json"
BUSY_EXIT = 142  # 128 + SIGALRM: the wait timed out; retryable, and distinct from preemption (143)


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


def _start_ticks(pid: int | str) -> str:
    """A live process's start time (clock ticks after boot; tells it from a reused pid), "" if it is
    gone or a zombie (exited, not yet reaped)."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rsplit(")", 1)[1].split() if stat else []
    return fields[19] if fields and fields[0] not in ("Z", "X") else ""


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

    # ---------------------------------------------------------------- file ops

    def _content(self) -> str:
        now = time.time()
        self.beats += 1
        data = {"owner": self.owner, **self.me, "beat": self.beats, "heartbeat_unix": now}
        return json.dumps(data, sort_keys=True) + "\n"

    def _read(self) -> dict | None:
        return read_lock_file(self.path)

    def _create(self, path: Path) -> bool:
        return create_exclusive(path, self._content(), durable=True)

    def _take_over(self) -> bool:
        """Rename the stale lease aside (only one waiter's rename finds it) and create ours."""
        aside = self.path.with_name(f"{LEASE}.stale-{self.owner}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            aside.unlink()
        return self._create(self.path)

    # ---------------------------------------------------------------- take, hold, release

    def acquire(self) -> None:
        """Take the lease, waiting for a live holder; LeaseNotTaken when it cannot be had."""
        check_writable_dir(self.path.parent, "--out")
        start = time.monotonic()
        seen, changed, logged = None, start, -1e9
        while True:
            if self.signalled():
                name = signal.Signals(self.signalled()).name
                raise LeaseNotTaken(
                    f"stopped by {name} while waiting for the lease on {self.path.parent}; nothing written",
                    128 + self.signalled(),
                )
            if self._create(self.path):
                break
            lease = self._read()
            if lease is None:
                continue  # released between our create and read: try again at once
            now = time.monotonic()
            if lease != seen:
                seen, changed = lease, now
            why = ""
            if lease and holder_is_dead(lease, self.me):
                why = f"its process (pid {lease.get('pid')} on this machine) is gone"
            elif now - changed >= self.stale_seconds:
                why = f"its heartbeat has not changed for {now - changed:.0f} s"
            elif lease and time.time() - float(lease.get("heartbeat_unix", 0)) >= self.stale_seconds:
                why = f"its last heartbeat is {time.time() - float(lease['heartbeat_unix']):.0f} s old"
            if why:
                if self._take_over():
                    self.log(
                        f"lease: took over the run dir lease of {describe(lease)}: {why} "
                        f"(checkpoint.lease_stale_seconds={self.stale_seconds:g})"
                    )
                    break
                continue
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
            lease = self._read()
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
        lease = self._read()
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
