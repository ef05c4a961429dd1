"""The watcher's Prometheus exporter: its own CollectorRegistry and port, so it never mixes with the
trainer's exporter when both run in one process (in-process mode)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from app.budget.policy import STATES
from app.budget.view import View


class BudgetMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def gauge(name: str, help_: str, *labels: str) -> Gauge:
            return Gauge(name, help_, labels, registry=r)

        def counter(name: str, help_: str, *labels: str) -> Counter:
            return Counter(name, help_, labels, registry=r)

        self.spent = gauge("pretrain_budget_spent_usd", "Spend recorded in the ledger (USD)")
        self.cap = gauge("pretrain_budget_cap_usd", "Budget cap (USD)")
        self.rate = gauge("pretrain_budget_rate_usd_per_hour", "Current spend rate (USD per hour)")
        self.projected = gauge(
            "pretrain_budget_projected_total_usd",
            "Spend projected at the next safe stopping point: max(poll, step + checkpoint) + poll + margin (USD)",
        )
        self.remaining = gauge("pretrain_budget_remaining_usd", "Cap minus spent (USD)")
        self.to_cap = gauge(
            "pretrain_budget_seconds_to_cap", "Seconds until the cap at the current rate (+Inf at rate 0)"
        )
        self.to_stop = gauge(
            "pretrain_budget_seconds_to_stop",
            "Seconds until the graceful budget stop fires at the current rate (+Inf at rate 0)",
        )
        self.decay = gauge("pretrain_budget_decay", "1 while the budget asks the trainer to decay its LR")
        self.state = gauge(
            "pretrain_budget_state", "1 for the current budget state, 0 for the others", "state"
        )
        self.source_up = gauge(
            "pretrain_budget_source_up",
            "1 when the spend source answered fresh data at the last poll",
            "source",
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
        self.stops = counter("pretrain_budget_stops_total", "Budget stops asked for", "mode")
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
        self.spent.set(view.spent_usd)
        self.cap.set(view.cap_usd)
        self.rate.set(view.rate_usd_per_hour)
        self.projected.set(view.projected_total_usd)
        self.remaining.set(view.remaining_usd)
        self.to_cap.set(math.inf if view.seconds_to_cap is None else view.seconds_to_cap)
        self.to_stop.set(math.inf if view.seconds_to_stop is None else view.seconds_to_stop)
        self.decay.set(1 if view.decay else 0)
        for s in STATES:
            self.state.labels(state=s).set(1 if s == view.state else 0)
        self.source_up.labels(source=view.source).set(1 if view.source_healthy else 0)
        if view.source_updated_unix:
            self.source_updated.set(view.source_updated_unix)
        self.last_poll.set(view.updated_unix)

    def serve(self, port: int, addr: str = "") -> int:
        """Start /metrics on port (0 = any free port; addr "" = the trainer's default); returns the port."""
        from app.trainer.metrics import bind_address

        server, _thread = start_http_server(port, addr=addr or bind_address(), registry=self.registry)
        self._server = server
        return server.server_address[1]

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
