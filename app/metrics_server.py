"""Where a process's Prometheus /metrics listens by default. The trainer's exporter
(app/trainer/reporting/metrics.py) and the budget watcher's (app/budget/metrics.py) each serve their own registry
on their own port, at the same address; the rule lives here, below both packages, so that app/budget/
never imports app/trainer/ (the trainer reaches the budget through app/trainer/stopping/budget_link.py alone).
"""

from __future__ import annotations

import os


def bind_address() -> str:
    """Every interface in a pod (Prometheus scrapes the pod IP), loopback elsewhere, so a laptop run does
    not expose its metrics to the network."""
    return "0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"
