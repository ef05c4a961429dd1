"""Where spend comes from: a static price, a JSON file kept current by a billing poller, or OpenCost.

A source only reports, never raises into the watcher: a failed or stale read comes back with ok=False
and an error line (a stale one still with its spend, a lower bound). docs/budget.md, "Fallback".
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.budget.files import is_amount
from app.config.budget import BudgetConfig


@dataclass(frozen=True)
class Reading:
    source: str
    ok: bool
    spent_usd: float | None = None  # the job's total spend as reported; None = the source only gives a rate
    rate_usd_per_hour: float = 0.0
    updated_unix: float = 0.0  # when the figure was true
    error: str = ""  # one line when not ok


def read_source(source: Source, now: float) -> Reading:
    """source.read, with an exception turned into a failed reading: a source must not kill the watcher."""
    try:
        return source.read(now)
    except Exception as e:
        return Reading(source.name, False, error=f"{type(e).__name__}: {e}")


@dataclass(frozen=True)
class StaticSource:
    """Price per GPU-hour x GPUs; the watcher integrates it over the time it runs."""

    name = "static"
    rate: float  # USD per hour

    def read(self, now: float) -> Reading:
        return Reading(self.name, True, None, self.rate, now)


def parse_utc(value: Any) -> float:
    """ISO-8601 to unix seconds; a time without an offset is UTC. ValueError when it is not a time."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected an ISO-8601 time string, got {value!r}")
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _number(data: dict, key: str) -> float:
    """data[key], a number >= 0 (0 when absent); ValueError when it is not."""
    val = data.get(key, 0.0)
    if not is_amount(val):
        raise ValueError(f"'{key}' must be a number >= 0, got {val!r}")
    return float(val)


def _check_fresh(name: str, spent: float, rate: float, updated: float, now: float, stale: float) -> Reading:
    age = now - updated
    if age < -stale:
        return Reading(
            name, False, None, rate, updated, f"last update is {-age:.0f} s in the future; check clocks"
        )
    if age > stale:
        return Reading(
            name, False, spent, rate, updated, f"stale: last update {age:.0f} s ago (> {stale:.0f} s)"
        )
    return Reading(name, True, spent, rate, min(updated, now))


class FileSource:
    """A JSON file in the seed's shape, written by a billing poller:
    {"spent_usd", "rate_usd_per_hr", "hours_elapsed", "projected_total_usd", "last_update_utc"}."""

    name = "file"

    def __init__(self, path: str, stale_seconds: float):
        self.path = Path(path)
        self.stale = stale_seconds

    def read(self, now: float) -> Reading:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return Reading(self.name, False, error=f"{self.path} does not exist")
        except OSError as e:
            return Reading(self.name, False, error=f"cannot read {self.path}: {e.strerror}")
        try:
            data = json.loads(text)
        except ValueError:
            return Reading(self.name, False, error=f"{self.path} is not valid JSON")
        if not isinstance(data, dict):
            return Reading(self.name, False, error=f"{self.path} must hold a JSON object")
        try:
            for key in ("spent_usd", "rate_usd_per_hr", "last_update_utc"):
                if key not in data:
                    raise ValueError(f"missing '{key}'")
            spent, rate = _number(data, "spent_usd"), _number(data, "rate_usd_per_hr")
            for key in ("hours_elapsed", "projected_total_usd"):  # optional, checked when present
                _number(data, key)
            updated = parse_utc(data["last_update_utc"])
        except ValueError as e:
            return Reading(self.name, False, error=f"{self.path}: {e}")
        return _check_fresh(self.name, spent, rate, updated, now, self.stale)


def _prom_label(key: str) -> str:
    """OpenCost takes Kubernetes label names in Prometheus form: training.kubeflow.org/job-name ->
    training_kubeflow_org_job_name."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class OpenCostSource:
    """OpenCost's allocation API, for the selector `<aggregate>:<value>` (docs/budget.md, "Sources"). The
    job's allocation is found by name: OpenCost names a label aggregate `value` or `key=value` depending
    on its version. Spend = totalCost since the run's first start; the rate is its change between reads."""

    name = "opencost"
    path = "/allocation/compute"

    def __init__(
        self, url: str, selector: str, window_start_unix: float, stale_seconds: float, timeout: float = 5.0
    ):
        self.url = url.rstrip("/")
        aggregate, _, value = selector.rpartition(":")
        if aggregate.startswith("label:"):
            key = aggregate[len("label:") :]
            aggregate = "label:" + _prom_label(key)
            self.names = {value, f"{key}={value}", f"{_prom_label(key)}={value}"}
        else:
            self.names = {value}
        self.aggregate = aggregate
        self.window_start = int(window_start_unix)
        self.stale = stale_seconds
        self.timeout = timeout
        self._prev: tuple[float, float] | None = None  # (total, end) of the last good read
        self._rate = 0.0

    def read(self, now: float) -> Reading:
        window = f"{min(self.window_start, int(now) - 60)},{int(math.ceil(now))}"
        query = urllib.parse.urlencode({"window": window, "aggregate": self.aggregate, "accumulate": "true"})
        url = f"{self.url}{self.path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            return Reading(self.name, False, error=f"OpenCost answered HTTP {e.code} for {self.path}")
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            return Reading(self.name, False, error=f"cannot reach OpenCost at {self.url}: {reason}")
        try:
            total, start, end = self._parse(json.loads(body))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return Reading(self.name, False, error=f"unexpected OpenCost response: {e}")
        self._update_rate(total, start, end)
        return _check_fresh(self.name, total, self._rate, end, now, self.stale)

    def _parse(self, resp: Any) -> tuple[float, float, float]:
        if not isinstance(resp, dict):
            raise ValueError("not a JSON object")
        if resp.get("code", 200) != 200:
            raise ValueError(f"code {resp.get('code')}: {resp.get('message', '')}".strip())
        sets = resp.get("data")
        if isinstance(sets, dict):
            sets = [sets]
        if not isinstance(sets, list):
            raise ValueError("'data' must be a list of allocation sets")
        total, start, end, found = 0.0, math.inf, 0.0, False
        for aset in sets:
            if not isinstance(aset, dict):
                continue
            for name, alloc in aset.items():
                if name not in self.names or not isinstance(alloc, dict):
                    continue
                cost = alloc["totalCost"]
                if not is_amount(cost):
                    raise ValueError(f"totalCost of '{name}' is {cost!r}")
                total += float(cost)
                start = min(start, parse_utc(alloc.get("start") or alloc["window"]["start"]))
                end = max(end, parse_utc(alloc.get("end") or alloc["window"]["end"]))
                found = True
        if not found:
            raise ValueError(
                f"no allocation named {' or '.join(sorted(self.names))} for aggregate={self.aggregate} "
                "(job too new for OpenCost, or check --opencost-selector)"
            )
        return total, start, end

    def _update_rate(self, total: float, start: float, end: float) -> None:
        if self._prev is not None:
            p_total, p_end = self._prev
            if end - p_end >= 60 and total >= p_total:
                self._rate = (total - p_total) / (end - p_end) * 3600
                self._prev = (total, end)
            return
        if end - start > 0:
            self._rate = total / (end - start) * 3600
        self._prev = (total, end)


Source = StaticSource | FileSource | OpenCostSource


def make_source(cfg: BudgetConfig, static_rate_usd_per_hour: float, window_start_unix: float) -> Source:
    if cfg.source == "file":
        return FileSource(cfg.source_path, cfg.stale_seconds)
    if cfg.source == "opencost":
        return OpenCostSource(cfg.opencost_url, cfg.opencost_selector, window_start_unix, cfg.stale_seconds)
    return StaticSource(static_rate_usd_per_hour)
