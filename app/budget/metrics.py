"""The watcher's Prometheus exporter: its own CollectorRegistry and port, so it never mixes with the
trainer's exporter when both run in one process (in-process mode)."""

from __future__ import annotations

import math
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from app.budget.policy import STATES
from app.budget.view import View
from app.metrics_server import bind_address

# the View's figures exported as they are, each as the gauge pretrain_budget_<field> (None, at rate 0: +Inf)
VIEW_GAUGES = {
    "spent_usd": "Spend recorded in the ledger (USD)",
    "cap_usd": "Budget cap (USD)",
    "rate_usd_per_hour": "Current spend rate (USD per hour)",
    "projected_total_usd": "Spend projected at the next safe stopping point: max(poll, step + checkpoint) + poll + margin (USD)",
    "remaining_usd": "Cap minus spent (USD)",
    "seconds_to_cap": "Seconds until the cap at the current rate (+Inf at rate 0)",
    "seconds_to_stop": "Seconds until the graceful budget stop fires at the current rate (+Inf at rate 0)",
    "decay": "1 while the budget asks the trainer to decay its LR",
}


class BudgetMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        gauge, counter = partial(Gauge, registry=self.registry), partial(Counter, registry=self.registry)
        self.of_view = {field: gauge(f"pretrain_budget_{field}", text) for field, text in VIEW_GAUGES.items()}
        self.state = gauge(
            "pretrain_budget_state", "1 for the current budget state, 0 for the others", ["state"]
        )
        self.source_up = gauge(
            "pretrain_budget_source_up",
            "1 when the spend source answered fresh data at the last poll",
            ["source"],
        )
        self.source_updated = gauge(
            "pretrain_budget_source_last_update_timestamp_seconds",
            "Unix time the source's latest good figure was true",
        )
        self.last_poll = gauge(
            "pretrain_budget_last_poll_timestamp_seconds", "Unix time of the watcher's last poll"
        )
        self.fallbacks = counter(
            "pretrain_budget_source_fallbacks_total",
            "Times the watcher fell back to the static rate because its source failed or went stale",
        )
        self.alerts = counter("pretrain_budget_alerts_total", "Budget alerts raised")
        self.stops = counter("pretrain_budget_stops_total", "Budget stops asked for", ["mode"])
        self.suspends = counter(
            "pretrain_budget_suspends_total", "PyTorchJob suspensions after an ignored immediate stop"
        )
        # the launch price guard (budget.max_price_per_gpu_hour; app/budget/price_guard.py)
        self.price = gauge("pretrain_budget_price_per_gpu_hour", "Current price of one GPU-hour (USD)")
        self.max_price = gauge(
            "pretrain_budget_max_price_per_gpu_hour", "Price ceiling of the launch price guard (USD)"
        )
        self.price_above = gauge("pretrain_budget_price_above_max", "1 while the price is above the ceiling")
        self.price_stops = counter(
            "pretrain_budget_price_stops_total", "Graceful stops because the price rose above the ceiling"
        )
        for s in STATES:
            self.state.labels(state=s).set(0)
        for mode in ("graceful", "immediate"):
            self.stops.labels(mode=mode)
        self._server = None

    def update(self, view: View) -> None:
        for field, gauge in self.of_view.items():
            value = getattr(view, field)
            gauge.set(math.inf if value is None else float(value))
        for s in STATES:
            self.state.labels(state=s).set(1 if s == view.state else 0)
        self.source_up.labels(source=view.source).set(1 if view.source_healthy else 0)
        if view.source_updated_unix:
            self.source_updated.set(view.source_updated_unix)
        self.last_poll.set(view.updated_unix)

    def serve(self, port: int, addr: str = "") -> int:
        """Start /metrics on port (0 = any free port; addr "" = the default, app/metrics_server.py); returns
        the port."""
        self._server, _thread = start_http_server(port, addr=addr or bind_address(), registry=self.registry)
        return self._server.server_address[1]

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
