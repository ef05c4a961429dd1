"""What the trainer reports: FLOPs/MFU accounting, the JSONL log, and the Prometheus exporter."""

from __future__ import annotations

import json
import time
from pathlib import Path

from app.config import ModelConfig
from app.gpus import key_of, known
from app.metrics_server import bind_address
from app.trainer.model.supervision import readouts_and_blocks_run


def peak_flops(gpu_type: str, override_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device; 0 when unknown (then MFU is not reported)."""
    row = known(gpu_type) if gpu_type else None
    return (override_tflops or (row.peak_tflops if row else 0.0)) * 1e12


def device_peak(gpu_type: str, override_tflops: float, device) -> tuple[str, float]:
    """(GPU type, peak FLOP/s): the configured type when the table knows it, else the CUDA name's."""
    if not peak_flops(gpu_type, override_tflops) and device.type == "cuda":
        import torch

        gpu_type = key_of(torch.cuda.get_device_name(device)) or gpu_type
    return gpu_type, peak_flops(gpu_type, override_tflops)


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6 x the matmul parameters a token passes through (q,o d x d, k,v d x kv_dim,
    SwiGLU 3 or ReLU squared 2 d x ff per block run, the output head per read-out; embedding and value
    embedding lookups are no matmuls) plus attention (scores and values 2 x 2 x T x d per layer forward,
    x3 with backward). The switches' norms, mixing weights, skips and soft-cap are elementwise: not counted."""
    d = cfg.d_model
    kv_dim = cfg.kv_heads * (d // cfg.n_head)
    block = 2 * d * d + 2 * d * kv_dim + cfg.mlp_matrices * d * cfg.ffn_dim
    readouts, runs = readouts_and_blocks_run(cfg)
    matmul_params = runs * block + readouts * d * cfg.padded_vocab  # the head matmul as it runs
    attention = 12 * runs * cfg.seq_len * d
    return 6 * matmul_params + attention


class JsonlLog:
    """Append-only metrics log in the run dir: one JSON object per line, flushed per write."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 (kept open for the run)

    def write(self, kind: str, step: int, **fields) -> None:
        self.f.write(json.dumps({"kind": kind, "step": step, "time": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        self.f.close()


class TrainerMetrics:
    """Prometheus gauges of one trainer process on its own registry and port."""

    def __init__(self, port: int, node: str, serve_global: bool, with_mfu: bool, addr: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server

        self.registry = r = CollectorRegistry()
        self.serve_global = serve_global
        self.node_tps = Gauge(
            "pretrain_node_tokens_per_second", "This node's training throughput", ["node"], registry=r
        ).labels(node=node)
        if serve_global:
            g = lambda name, doc: Gauge(name, doc, registry=r)  # noqa: E731
            self.step = g("pretrain_step", "Optimizer steps done")
            self.tokens = Counter("pretrain_tokens", "Tokens trained on", registry=r)
            self.train_loss = g("pretrain_train_loss", "Latest train loss (nats/token)")
            self.val_loss = g("pretrain_val_loss", "Latest validation loss (nats/token)")
            self.val_bpb = g("pretrain_val_bits_per_byte", "Validation bits per UTF-8 byte")
            self.lr = g("pretrain_learning_rate", "Current learning rate")
            self.grad_norm = g("pretrain_grad_norm", "Global gradient norm before clipping")
            self.tps = g("pretrain_tokens_per_second", "Global training throughput (tokens/s)")
            # Absent (not 0) without a known peak: an MFU alert must not fire on a CPU run.
            self.mfu = g("pretrain_mfu_ratio", "Model FLOPs utilisation (0..1)") if with_mfu else None
            self.step_seconds = g(
                "pretrain_step_seconds", "Wall time per optimizer step, averaged since the last log"
            )
            self.data_wait = g(
                "pretrain_data_wait_seconds",
                "Time per step spent waiting for data, averaged since the last log",
            )
            self.ckpt_seconds = g("pretrain_checkpoint_seconds", "Duration of the last checkpoint save")
            self.ckpt_step = g("pretrain_last_checkpoint_step", "Step of the last checkpoint")
            self.ckpt_time = g(
                "pretrain_last_checkpoint_timestamp_seconds", "Unix time of the last checkpoint"
            )
            self.last_step_time = g(
                "pretrain_last_step_timestamp_seconds", "Unix time the last step finished"
            )
            self.planned_end = g(
                "pretrain_planned_end_timestamp_seconds",
                "Expected unix time of the planned end (max steps / tokens / hours) at the current pace",
            )
            self.stop_state = g(
                "pretrain_stop_state",
                "0 running, 1 planned end, 2 early stop, 3 budget stop, 4 preempted, 5 immediate, 6 diverged, "
                "7 graceful stop file (not the budget's)",
            )
            self.gpu_mem = g("pretrain_gpu_memory_bytes", "Peak CUDA memory allocated")
            self.loop_loss = Gauge(
                "pretrain_loop_loss", "Loss after each recurrence (looped models)", ["loop"], registry=r
            )
            self.refinement = g(
                "pretrain_refinement_ratio", "(loss_first - loss_last) / loss_first over loops"
            )
            self.loop_monotone = g(
                "pretrain_loop_monotone", "1 when every loop lowered the loss (loss_0 > loss_1 > ...), else 0"
            )
            self.supervision_loss = g(
                "pretrain_supervision_loss", "Deep supervision: weighted per-loop loss S = sum_i w_i L_i"
            )
            self.improvement_reward = g(
                "pretrain_improvement_reward",
                "Deep supervision: mean relative gain of a read-out over the previous one (I)",
            )
            self.spikes = Counter("pretrain_loss_spikes", "Loss spikes detected", registry=r)
            self.spike = g("pretrain_loss_spike", "1 while the last step was a loss spike")
            self.info = Info("pretrain", "Run description", registry=r)
            self.tracker_errors = Counter(
                "pretrain_tracker_errors", "Failed writes to experiment trackers", ["tracker"], registry=r
            )
        self.server, self.thread = start_http_server(port, addr=addr or bind_address(), registry=r)

    def close(self) -> None:
        self.server.shutdown()
