"""The budget's section (`budget:`): the cap, where spend comes from, and when to alert, decay and stop;
the flags that set it (named by `flag_for`) and its checks. Read by the trainer and by `pretrain watch`."""

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
    """The spend cap, where spend comes from, and when to alert, decay the LR and stop (docs/budget.md).
    Read by the trainer (`budget:` of its config) and by `pretrain watch` (the same section, and flags)."""

    cap_usd: float = 0.0  # spend cap in US dollars for the whole run, over all restarts; 0 = no cap
    gpu_type: str = ""  # GPU type key of the built-in price table, e.g. a100-80gb, h100-sxm
    price_per_gpu_hour: float = 0.0  # price of one GPU-hour in USD; 0 = the price table's for the GPU type
    gpus: int = 0  # GPUs billed (nodes x GPUs per node); 0 = the trainer's world size (1 on a CPU)
    # where spend comes from: static (price x GPUs x time), file (JSON kept by a billing poller), opencost
    source: str = "static"
    source_path: str = ""  # JSON spend file for source=file, kept current by a billing poller
    opencost_url: str = ""  # OpenCost API base URL for source=opencost, e.g. http://opencost.opencost:9003
    # the job's OpenCost allocation for source=opencost, <aggregate>:<value>, e.g.
    # label:training.kubeflow.org/job-name:NAME
    opencost_selector: str = ""
    poll_seconds: float = 10.0  # seconds between the watcher's polls of the spend source
    stale_seconds: float = 300.0  # a source figure older than this falls back to the static rate
    alert_fraction: float = 0.8  # alert when spent >= this fraction of the cap
    alert_usd: float = 0.0  # also alert when spent >= this amount, whichever comes first; 0 = off
    margin_seconds: float = 60.0  # safety margin added to step + checkpoint time when projecting the stop
    decay_fraction: float = 0.15  # WSD: fraction of the run the budget-driven LR decay takes
    # run the watcher as a thread on rank 0; false when a sidecar watches (Kubernetes)
    in_process: bool = True
    metrics_port: int = 0  # the watcher's Prometheus /metrics port; 0 = off (`pretrain watch`: 9401)
    price_table: str = ""  # JSON/YAML file {gpu_type: usd_per_gpu_hour} overriding the built-in prices
    # Kubernetes Events and last-resort suspend: auto (in a cluster with a job name), on, off
    kube: str = "auto"
    job_name: str = ""  # the job's name for Events and suspend; "" = $PRETRAIN_JOB_NAME
    job_kind: str = ""  # the job's kind: PyTorchJob or TrainJob; "" = $PRETRAIN_JOB_KIND, else PyTorchJob
    namespace: str = ""  # the job's namespace; "" = $POD_NAMESPACE or the service account's
    # suspend the job when the trainer still runs this long after an immediate stop
    suspend_grace_seconds: float = 120.0
    # time charged to the cap before the trainer first reports training (an image pull, a crash loop before
    # step 1; a data prepare runs before the pods exist); the rest is recorded in the ledger as unbilled_usd,
    # not spent from the budget
    idle_allowance_seconds: float = 1800.0
    # price guard: no training while a GPU-hour costs more than this many USD (checked at launch, and by
    # the watcher at every poll); 0 = off
    max_price_per_gpu_hour: float = 0.0


# The flag that sets a budget field is named like the field (--poll-seconds sets budget.poll_seconds),
# in `pretrain watch` and `pretrain train` alike, except where the value has a name of its own: the cap is
# --budget-cap-usd everywhere (the chart's budget.capUSD), since a bare --cap-usd would not say what it caps.
FLAG_NAMES = {"cap_usd": "--budget-cap-usd"}


def flag_for(field: str) -> str:
    """The flag that sets budget.<field>."""
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)  # a UserError: one line, exit 2


def check_shared_keys(cfg: BudgetConfig) -> None:
    """The budget checks `pretrain train` runs when it loads its config (app.config.checks.validate)."""
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
