"""Where a run's numbers go (`metrics:`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MetricsConfig:
    """Where the run's numbers go besides the console: Prometheus, MFU's peak, experiment trackers."""

    port: int = 0  # Prometheus /metrics on this port (global rank 0 and each node's local rank 0); 0 = off
    addr: str = ""  # /metrics bind address; "" = 0.0.0.0 in a pod (KUBERNETES_SERVICE_HOST), else 127.0.0.1
    gpu_type: str = ""  # key of the peak-FLOPs table; "" = detect from the CUDA device name
    peak_tflops: float = 0.0  # override peak dense bf16 TFLOP/s per device (also enables MFU on CPU)
    progress: bool = True  # a progress bar on a terminal console (else log lines)
    # Experiment trackers fed the same records as metrics.jsonl (rank 0): any of tensorboard, mlflow, wandb
    trackers: list[str] = field(default_factory=list)
    tensorboard_dir: str = ""  # TensorBoard log dir; "" = RUN_DIR/tensorboard
    # MLflow tracking URI; "" = $MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns
    mlflow_uri: str = ""
    mlflow_experiment: str = "pretrain"  # the MLflow experiment the run is logged under
    wandb_project: str = "pretrain"  # the W&B project the run is logged under
    wandb_entity: str = ""  # W&B entity (team or user); "" = your W&B default entity
    wandb_mode: str = ""  # W&B mode: online | offline | disabled; "" = $WANDB_MODE, else online
    tracker_run_name: str = ""  # the run's name in the trackers; "" = the run dir's name
    tracker_checkpoint: bool = True  # log the final checkpoint as an artifact (MLflow, W&B) on exit 0
