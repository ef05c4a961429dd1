"""The files the watcher shares with the trainer: status.json in, the stop file out (atomic writes)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from app.files import atomic_write_json


def is_amount(val: object) -> bool:
    """A finite number >= 0 as JSON or YAML gives it (a bool is not a number here)."""
    return isinstance(val, int | float) and not isinstance(val, bool) and math.isfinite(val) and val >= 0


def _num(data: dict, key: str) -> float:
    val = data.get(key, 0.0)
    return float(val) if is_amount(val) else 0.0


@dataclass(frozen=True)
class TrainerStatus:
    """The trainer's heartbeat (RUN_DIR/status.json); only what the projection needs."""

    step: int
    step_seconds: float
    checkpoint_seconds: float
    state: str
    updated_unix: float
    checkpoint_write_seconds: float = 0.0  # of checkpoint_seconds, what ran in the background
    event: dict | None = None  # {"reason", "message", "posted"}: the trainer's Event, to relay


def read_json_object(path: Path) -> dict | None:
    """A JSON object file (status.json, the stop file, state.json); None when missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


read_stop_file = read_json_object


def read_status(path: Path) -> TrainerStatus | None:
    """None when missing or unreadable: the trainer may not have started yet, which is not an error."""
    data = read_json_object(path)
    if data is None:
        return None
    step = data.get("step", 0)
    step = step if isinstance(step, int) and not isinstance(step, bool) else 0
    seconds = {f.name: _num(data, f.name) for f in fields(TrainerStatus) if f.type == "float"}
    event = data.get("event") if isinstance(data.get("event"), dict) else None
    return TrainerStatus(step=step, state=str(data.get("state", "")), event=event, **seconds)


def write_stop_file(path: Path, mode: str, reason: str, now: float) -> None:
    """Ask the trainer to stop (contract shape). Never downgrades an immediate stop someone already asked
    for, and leaves an existing graceful request alone unless escalating."""
    current = (read_stop_file(path) or {}).get("mode")
    if current == "immediate" or current == mode == "graceful":
        return
    data = {"mode": mode, "cause": "budget", "reason": reason, "written_unix": now}
    atomic_write_json(Path(path), data, durable=True)


def clear_stale_budget_stop(path: Path) -> None:
    """Remove a budget stop file left by an earlier run (local runs keep RUN_DIR/stop.json), so a raised
    cap can train again. Stop files from users or other causes are never touched."""
    if (read_stop_file(path) or {}).get("cause") == "budget":
        with contextlib.suppress(OSError):
            Path(path).unlink()
