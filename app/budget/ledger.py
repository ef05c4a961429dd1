"""The spend ledger (RUN_DIR/budget/ledger.json), on the checkpoint volume so that spend accumulates across
restarts and preemptions. docs/budget.md, "How spend is tracked: the ledger".
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.budget.files import is_amount
from app.errors import UserError
from app.files import atomic_write_json, not_a_directory, not_a_directory_message, unwritable_message

LEDGER_VERSION = 1
MAX_SESSIONS = 200


class LedgerError(UserError):
    """The ledger cannot be trusted; a human must look (guessing could overspend)."""


@dataclass
class StopRecord:
    """A budget stop the watcher asked for; it is final for the cap it was decided under."""

    mode: str  # graceful | immediate
    reason: str
    cap_usd: float
    spent_usd: float
    unix: float


@dataclass
class Session:
    start_unix: float
    end_unix: float = 0.0  # 0 while open
    spent_usd: float = 0.0  # charged during this session
    host: str = ""  # sidecar | in-process | dry-run
    pid: int = 0
    clean: bool = False  # closed by the watcher (not killed)


@dataclass
class Ledger:
    spent_usd: float = 0.0
    reserved_usd: float = 0.0  # charged if the open session dies without closing
    open_session: bool = False
    cap_usd: float = 0.0  # the cap of the latest session
    created_unix: float = 0.0  # first session: OpenCost's window starts here
    updated_unix: float = 0.0
    running_seconds: float = 0.0  # wall time charged in all sessions
    source: str = ""
    rate_usd_per_hour: float = 0.0  # latest rate, for projections across restarts
    step_seconds: float = 0.0  # latest trainer timings, for projections before status.json appears
    checkpoint_seconds: float = 0.0
    checkpoint_write_seconds: float = 0.0  # background part of the last asynchronous save
    alerted_cap_usd: float = 0.0  # the cap an alert was already raised for (no repeats on restart)
    crashes: int = 0  # sessions that ended without closing
    trained_unix: float = 0.0  # when the trainer first reported training (0 = not yet)
    idle_seconds: float = 0.0  # time before that, over all sessions
    unbilled_seconds: float = 0.0  # the part of it beyond budget.idle_allowance_seconds: not charged
    unbilled_usd: float = 0.0  # what that part cost, recorded but not counted against the cap
    stop: StopRecord | None = None
    sessions: list[Session] = field(default_factory=list)
    price_guard: dict | None = None  # the launch price guard's latest verdict (app/budget/price_guard.py)
    version: int = LEDGER_VERSION

    def effective_spent(self) -> float:
        """Spent, counting the reservation of a session that did not close (or is still open)."""
        return self.spent_usd + (self.reserved_usd if self.open_session else 0.0)

    def to_json(self) -> dict[str, Any]:
        out = dict(vars(self))  # shallow: dataclasses.asdict deep-copies, too slow for the simulations
        out["stop"] = dict(vars(self.stop)) if self.stop else None
        out["sessions"] = [dict(vars(s)) for s in self.sessions]
        return out


def _bad(path: Path, what: str) -> LedgerError:
    return LedgerError(
        f"budget ledger {path} is corrupt ({what}); restore it from a backup or delete it "
        f"(deleting resets the recorded spend of this run to $0)"
    )


def _floats(cls: type, data: dict, path: Path) -> dict[str, float]:
    """The float fields of dataclass `cls` from `data`, each a number >= 0 (0 when absent)."""
    out = {}
    for name in (f.name for f in dataclasses.fields(cls) if f.type in ("float", float)):
        val = data.get(name, 0.0)
        if not is_amount(val):
            raise _bad(path, f"'{name}' must be a number >= 0, got {val!r}")
        out[name] = float(val)
    return out


def ledger_from_json(data: Any, path: Path) -> Ledger:
    if not isinstance(data, dict):
        raise _bad(path, "not a JSON object")
    if data.get("version", LEDGER_VERSION) != LEDGER_VERSION:
        raise _bad(path, f"version {data.get('version')!r}, this build reads {LEDGER_VERSION}")
    led = Ledger(**_floats(Ledger, data, path))
    led.open_session = bool(data.get("open_session", False))
    led.source = str(data.get("source", ""))
    crashes = data.get("crashes", 0)
    led.crashes = crashes if isinstance(crashes, int) and crashes >= 0 else 0
    stop = data.get("stop")
    if stop is not None:
        if not isinstance(stop, dict) or stop.get("mode") not in ("graceful", "immediate"):
            raise _bad(path, f"'stop' must be null or a stop record, got {stop!r}")
        led.stop = StopRecord(stop["mode"], str(stop.get("reason", "")), **_floats(StopRecord, stop, path))
    guard = data.get("price_guard")
    led.price_guard = guard if isinstance(guard, dict) else None
    sessions = data.get("sessions", [])
    if not isinstance(sessions, list):
        raise _bad(path, "'sessions' must be a list")
    for s in sessions:
        if isinstance(s, dict):
            host, pid, clean = str(s.get("host", "")), int(s.get("pid", 0) or 0), bool(s.get("clean", False))
            led.sessions.append(Session(**_floats(Session, s, path), host=host, pid=pid, clean=clean))
    return led


def load_ledger(path: Path) -> Ledger:
    """The run's ledger; a fresh one when the file does not exist yet."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Ledger()
    except OSError as e:
        if (blocker := not_a_directory(path.parent)) is not None:
            raise LedgerError(not_a_directory_message(path, "budget ledger", blocker)) from None
        raise LedgerError(f"cannot read budget ledger {path}: {e.strerror}; check the volume mount") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise _bad(path, "not valid JSON") from None
    return ledger_from_json(data, path)


def save_ledger(path: Path, ledger: Ledger) -> None:
    ledger.sessions = ledger.sessions[-MAX_SESSIONS:]
    atomic_write_json(Path(path), ledger.to_json(), durable=True)


class LedgerLock:
    """One watcher per ledger: a sidecar and an in-process watcher on the same run would each charge
    the same hours. flock is released by the kernel when the holder dies, so a crash leaves no lock."""

    def __init__(self, ledger_path: Path):
        self.path = Path(ledger_path).with_name(Path(ledger_path).name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(unwritable_message(self.path, "the ledger lock", e.strerror)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = ""
                with contextlib.suppress(OSError):
                    holder = f" (pid {self.path.read_text().strip()})"
                raise UserError(
                    f"another budget watcher holds {self.path}{holder}; run one watcher per run: "
                    f"a sidecar (`pretrain watch`) or the trainer's thread (budget.in_process=true), not both"
                ) from None
            return  # the filesystem cannot lock (some network volumes): carry on unlocked
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
