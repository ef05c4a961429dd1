"""The budget files in a run dir and the watcher's view of them (RUN_DIR/budget/state.json): what the
metrics, the CLI and the trainer read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.budget.files import read_json_object


def ledger_path_for(run_dir: Path) -> Path:
    return Path(run_dir) / "budget" / "ledger.json"


def state_path_for(run_dir: Path) -> Path:
    return Path(run_dir) / "budget" / "state.json"


@dataclass(frozen=True)
class View:
    """The watcher's latest view: RUN_DIR/budget/state.json (contract fields first) and the metrics."""

    spent_usd: float
    cap_usd: float
    rate_usd_per_hour: float
    projected_total_usd: float
    remaining_usd: float
    seconds_to_cap: float | None
    state: str
    source: str
    source_healthy: bool
    updated_unix: float
    # extras, beyond the contract
    seconds_to_stop: float | None
    decay: bool
    decay_seconds: float | None
    horizon_seconds: float
    stop_mode: str
    step_seconds: float
    checkpoint_seconds: float
    source_error: str
    source_updated_unix: float


def read_budget_state(run_dir: Path) -> dict[str, Any] | None:
    """RUN_DIR/budget/state.json as a dict, or None when absent or unreadable."""
    return read_json_object(state_path_for(run_dir))
