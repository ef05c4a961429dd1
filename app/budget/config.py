"""Budget settings: the cap, where spend comes from, and when to alert, decay and stop."""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.errors import ConfigError

CHOICES = {  # valid values
    "source": ("static", "file", "opencost"),
    "kube": ("auto", "on", "off"),
    "job_kind": ("", "PyTorchJob", "TrainJob"),
}


@dataclass
class BudgetConfig:
    cap_usd: float = 0.0  # 0 = no budget guard
    gpu_type: str = ""  # key of the built-in price table (e.g. a100-80gb); "" = cpu / unknown
    price_per_gpu_hour: float = 0.0  # overrides the table; 0 = use the table
    gpus: int = 0  # GPUs billed; 0 = world size (or 1 on CPU)
    source: str = "static"  # static | file | opencost
    source_path: str = ""  # JSON spend file for source=file
    opencost_url: str = ""  # e.g. http://opencost.opencost:9003 for source=opencost
    opencost_selector: str = ""  # allocation filter, e.g. label:training.kubeflow.org/job-name:pretrain
    poll_seconds: float = 10.0  # how often the watcher reads its source
    stale_seconds: float = 300.0  # a source older than this falls back to the static rate
    alert_fraction: float = 0.8  # alert when spent >= this fraction of the cap
    alert_usd: float = 0.0  # or at this amount (whichever comes first); 0 = off
    margin_seconds: float = 60.0  # safety margin added to (step + checkpoint) when projecting
    decay_fraction: float = 0.15  # WSD: fraction of the run spent in the budget-driven LR decay
    # run the watcher as a thread on rank 0; false when a sidecar watches (Kubernetes)
    in_process: bool = True
    metrics_port: int = 0  # watcher /metrics port; 0 = off (`pretrain watch` defaults to 9401)
    price_table: str = ""  # JSON/YAML file {gpu_type: price_per_gpu_hour} overriding the built-in table
    kube: str = "auto"  # auto (in a cluster with a job name) | on | off: Events and last-resort suspend
    job_name: str = ""  # the job's name for Events/suspend; "" = $PRETRAIN_JOB_NAME
    job_kind: str = ""  # PyTorchJob | TrainJob (Trainer v2); "" = $PRETRAIN_JOB_KIND, else PyTorchJob
    namespace: str = ""  # its namespace; "" = $POD_NAMESPACE or the service account's namespace
    suspend_grace_seconds: float = 120.0  # after an immediate stop, suspend the job if the trainer still runs
    # Until the trainer first reports training (a data wait, a crash loop before step 1), only this much time
    # is charged to the cap; the rest is recorded in the ledger as unbilled_usd, not spent from the budget.
    idle_allowance_seconds: float = 1800.0
    max_price_per_gpu_hour: float = 0.0  # launch price guard: do not train above this USD/GPU-hour; 0 = off


def is_amount(val: object) -> bool:
    """A finite number >= 0 as JSON or YAML gives it (a bool is not a number here)."""
    return isinstance(val, int | float) and not isinstance(val, bool) and math.isfinite(val) and val >= 0


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)  # a UserError: one line, exit 2


def check_shared_keys(cfg: BudgetConfig) -> None:
    """The budget checks `pretrain train` runs when it loads its config (app.config_checks.validate)."""
    _need(0 < cfg.alert_fraction <= 1, f"budget.alert_fraction must be in (0, 1], got {cfg.alert_fraction}")
    _need(0 < cfg.decay_fraction < 1, f"budget.decay_fraction must be in (0, 1), got {cfg.decay_fraction}")
    for key, choices in CHOICES.items():
        val = getattr(cfg, key)
        _need(val in choices, f"budget.{key}='{val}' is not valid; choose one of: {', '.join(choices)}")


def check_budget_config(cfg: BudgetConfig) -> None:
    """Validate what the watcher needs, in one line per mistake."""
    for key in (
        "cap_usd",
        "price_per_gpu_hour",
        "alert_usd",
        "margin_seconds",
        "suspend_grace_seconds",
        "idle_allowance_seconds",
        "max_price_per_gpu_hour",
    ):
        val = getattr(cfg, key)
        _need(math.isfinite(val) and val >= 0, f"budget.{key} must be a finite number >= 0, got {val}")
    _need(cfg.gpus >= 0, f"budget.gpus must be >= 0, got {cfg.gpus}")
    _need(cfg.poll_seconds > 0, f"budget.poll_seconds must be > 0, got {cfg.poll_seconds}")
    _need(
        cfg.stale_seconds > cfg.poll_seconds,
        f"budget.stale_seconds={cfg.stale_seconds} must exceed budget.poll_seconds={cfg.poll_seconds}",
    )
    _need(
        0 <= cfg.metrics_port < 65536, f"budget.metrics_port must be a TCP port or 0, got {cfg.metrics_port}"
    )
    check_shared_keys(cfg)
    if cfg.source == "file":
        _need(bool(cfg.source_path), "budget.source=file needs budget.source_path (--source-path FILE.json)")
    if cfg.source == "opencost":
        _need(bool(cfg.opencost_url), "budget.source=opencost needs budget.opencost_url (--opencost-url URL)")
        _need(
            cfg.opencost_selector.count(":") >= 1,
            "budget.source=opencost needs budget.opencost_selector like "
            "label:training.kubeflow.org/job-name:NAME or namespace:NS (--opencost-selector)",
        )
