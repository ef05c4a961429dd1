"""Where the loop's numbers go: the console (a tqdm bar on a terminal, else plain lines), the JSONL log
(RUN_DIR/metrics.jsonl, global rank 0) and the Prometheus exporter. The loop hands over plain records;
this file decides who sees what, so a new sink is added here and nowhere else. Experiment trackers
(app/trainer/reporting/trackers.py) get every record that metrics.jsonl gets.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from app.config import Config
from app.errors import UserError
from app.files import cut_torn_line
from app.metrics_server import bind_address
from app.trainer.model import supervision
from app.trainer.parallel.distributed import DistEnv
from app.trainer.reporting.metrics import JsonlLog, TrainerMetrics
from app.trainer.reporting.steplog import StepRow
from app.trainer.stopping.causes import StopDecision


class Reporter:
    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path, peak_flops: float = 0.0) -> None:
        """`peak_flops`: of one device; MFU is reported when it is known (0: unknown, MFU stays absent)."""
        self.cfg = cfg
        self.env = env
        self.rank0 = env.is_rank0
        self.progress = None
        self.flops_per_token = 0.0
        self.peak = peak_flops
        self.step_seconds = 0.0  # moving average over reads of the step log: the device's pace
        self.reset_window()
        self.metrics: TrainerMetrics | None = None
        self.jsonl: JsonlLog | None = None
        if cfg.metrics.port and env.local_rank == 0:
            try:
                self.metrics = TrainerMetrics(
                    cfg.metrics.port,
                    env.node,
                    serve_global=self.rank0,
                    with_mfu=bool(peak_flops),
                    addr=cfg.metrics.addr,
                )
            except OSError as e:
                raise UserError(
                    f"metrics port {cfg.metrics.addr or bind_address()}:{cfg.metrics.port} is not available "
                    f"({e.strerror}); pick another --metrics-port, or 0 for none"
                ) from None
        if self.rank0:
            self.jsonl = JsonlLog(cut_torn_line(Path(run_dir) / "metrics.jsonl"))
        self.trackers = None
        if self.rank0 and cfg.metrics.trackers:
            from app.trainer.reporting.trackers import Trackers

            self.trackers = Trackers(cfg, Path(run_dir), self._tracker_warning, self._tracker_error)
            for name in cfg.metrics.trackers if self.global_metrics else ():  # 0, not absent, until one fails
                self.global_metrics.tracker_errors.labels(tracker=name)
        self.run_name = Path(run_dir).name
        self.exit_code = 1  # until a stop event says otherwise
        self.last_step = 0

    @property
    def global_metrics(self) -> TrainerMetrics | None:
        """The exporter of global rank 0 (the one with every gauge), else None."""
        return self.metrics if self.rank0 else None

    # ------------------------------------------------------------ console

    def log(self, msg: str, file=None) -> None:
        """A line on rank 0's console (stdout, or `file`), above the progress bar."""
        if self.rank0:
            if self.progress is not None:
                self.progress.write(msg, file=file)
            else:
                print(msg, file=file, flush=True)

    def warn(self, msg: str) -> None:
        self.log(msg, sys.stderr)

    def reset_window(self) -> None:
        """Start measuring throughput afresh (after setup or the step-0 eval)."""
        self.window_tokens = 0
        self.window_steps = 0
        self.window_start = time.perf_counter()

    def window(self) -> tuple[float, float]:
        """(tokens/s, seconds per step) since the last call, then start a new window. Called when the
        step log is read, which waits for the device: the figures are the device's pace, not the host's.
        Also moves `step_seconds`, the pace the stop agreement and the heartbeat use."""
        seconds = max(time.perf_counter() - self.window_start, 1e-9)
        tokens_per_second = self.window_tokens / seconds
        per_step = seconds / max(self.window_steps, 1)
        self.reset_window()
        if self.step_seconds == 0:
            self.step_seconds = per_step
        else:
            self.step_seconds = 0.5 * (self.step_seconds + per_step)
        return tokens_per_second, per_step

    def mfu(self, tokens_per_second: float) -> float | None:
        """Model FLOPs utilisation at this throughput of the whole job; None without a known peak."""
        if not self.peak:
            return None
        return self.flops_per_token * tokens_per_second / (self.peak * self.env.world_size)

    def open_progress(self, total: int, initial: int) -> None:
        self.reset_window()
        if self.rank0 and self.cfg.metrics.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.progress = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    # ------------------------------------------------------------ records

    def record(self, kind: str, step: int, **fields) -> None:
        """One record (train | eval | checkpoint | event) for metrics.jsonl and the trackers."""
        self.last_step = step
        if self.jsonl:
            self.jsonl.write(kind, step, **fields)
        if self.trackers:
            self.trackers.record(kind, step, fields)

    def event(self, name: str, step: int, **fields) -> None:
        """An event of the run (start, stop): a record of kind "event" named `name`."""
        self.record("event", step, event=name, **fields)

    def stopped(self, step: int, decision: StopDecision) -> None:
        """The stop event; its exit code is how the trackers end the run."""
        self.exit_code = decision.exit_code
        self.event(
            "stop",
            step,
            cause=decision.name,
            reason=decision.reason,
            exit_code=decision.exit_code,
        )

    def _tracker_warning(self, tracker: str, message: str, error: str) -> None:
        self.log(f"warning: {message}")
        if self.jsonl:  # straight to the log: a tracker's own failure is not fed back to the trackers
            self.jsonl.write("event", self.last_step, event="tracker_error", tracker=tracker, error=error)

    def _tracker_error(self, tracker: str) -> None:
        if self.global_metrics:
            self.global_metrics.tracker_errors.labels(tracker=tracker).inc()

    def started(
        self, *, counts, flops_per_token: float, tokens: int, checkpoint: tuple[int, float] | None
    ) -> None:
        """The run's model is built and resumed: its size, and the counters it continues from its checkpoint
        (`checkpoint`: the step and save time of the run dir's checkpoint it resumed from)."""
        self.flops_per_token = flops_per_token
        self.log(f"preset {self.cfg.preset}: {counts}")
        gauges = self.global_metrics
        if gauges is None:
            return
        gauges.tokens.inc(tokens)
        if checkpoint is not None:
            checkpoint_step, checkpoint_unix = checkpoint
            gauges.ckpt_step.set(checkpoint_step)
            gauges.ckpt_time.set(checkpoint_unix)
        gauges.info.info(
            {
                "preset": self.cfg.preset,
                "run": self.run_name,
                "world_size": str(self.env.world_size),
                "parameters": str(counts.total),
                "non_embedding_parameters": str(counts.non_embedding),
            }
        )

    def step_done(self, step: int, tokens_per_step: int) -> None:
        """Every step, cheap: what the stalled-training alert and the token counter need."""
        self.window_tokens += tokens_per_step
        self.window_steps += 1
        if self.progress is not None:
            self.progress.update(1)
        gauges = self.global_metrics
        if gauges is not None:
            gauges.step.set(step)
            gauges.tokens.inc(tokens_per_step)
            gauges.last_step_time.set(time.time())

    def guards(self, row: StepRow, bad: bool, spike: bool, bad_steps, spikes, skipping_spikes: bool) -> None:
        """What the divergence guard and the spike detector found in a step, as they saw it."""
        if bad:
            self.warn(
                f"step {row.step}: loss {row.loss} / gradient norm {row.grad_norm} is not finite: update "
                f"skipped ({bad_steps.in_a_row} in a row; the run stops at "
                f"train.max_bad_steps={bad_steps.max_bad})"
            )
        if spike:
            skipped = " (update skipped)" if skipping_spikes else ""
            self.log(
                f"loss spike at step {row.step}: {row.loss:.3f} vs moving average {spikes.avg:.3f}{skipped}"
            )

    def train(
        self,
        row: StepRow,
        *,
        tokens: int,
        tokens_per_second: float,
        step_seconds: float,
        data_wait_seconds: float,
        spike: bool,
        bad: bool,
        injected: bool,
        seconds_to_planned_end: float,
    ) -> None:
        """A train record. Throughput, step time and data wait are the averages over the window since the
        last read of the step log; `seconds_to_planned_end`: seconds to the planned end at this pace."""
        tps = tokens_per_second
        mfu = self.mfu(tps)
        loops = row.loop_losses
        record = {
            "loss": row.loss,
            "lr": row.lr,
            "grad_norm": row.grad_norm,
            "tokens": tokens,
            "tokens_per_second": tps,
            "step_seconds": step_seconds,
            "data_wait_seconds": data_wait_seconds,
        }
        if mfu is not None:
            record["mfu"] = mfu
        if (
            loops
        ):  # the objective's terms, from this step's mean per-loop losses (app/trainer/model/supervision.py)
            loop_cfg = self.cfg.model.loop
            weights = supervision.loop_weights(loop_cfg, len(loops))
            terms = supervision.objective(loops, weights, loop_cfg.improvement_reward_scale)
            record["loop_losses"] = loops
            record["refinement"] = supervision.refinement(loops)
            record["loop_monotone"] = supervision.monotone(loops)
            record["supervision_loss"] = terms.supervision
            record["improvement_reward"] = terms.improvement
        for key, flag in (("spike", spike), ("skipped_nonfinite", bad), ("injected_spike", injected)):
            if flag:
                record[key] = True
        self.record("train", row.step, **record)
        if self.metrics:
            self.metrics.node_tps.set(tps * self.env.local_world_size / self.env.world_size)
        gauges = self.global_metrics
        if gauges is not None:
            for gauge, value in (
                (gauges.train_loss, row.loss),
                (gauges.lr, row.lr),
                (gauges.grad_norm, row.grad_norm),
                (gauges.tps, tps),
                (gauges.step_seconds, step_seconds),
                (gauges.data_wait, data_wait_seconds),
                (gauges.planned_end, time.time() + seconds_to_planned_end),
                (gauges.spike, int(spike)),
            ):
                gauge.set(value)
            if mfu is not None:
                gauges.mfu.set(mfu)
            if spike:
                gauges.spikes.inc()
            for index, loss in enumerate(loops):
                gauges.loop_loss.labels(loop=str(index)).set(loss)
            if loops:  # the gauges bear the record's names
                for key in ("refinement", "loop_monotone", "supervision_loss", "improvement_reward"):
                    getattr(gauges, key).set(record[key])
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                gauges.gpu_mem.set(torch.cuda.max_memory_allocated())
        if self.progress is not None:
            postfix = {"loss": f"{row.loss:.3f}", "tok/s": f"{tps:,.0f}"}
            if mfu is not None:
                postfix["mfu"] = f"{mfu:.1%}"
            self.progress.set_postfix(postfix, refresh=False)
        else:
            self.log(
                f"step {row.step}/{self.cfg.train.max_steps} loss {row.loss:.4f} lr {row.lr:.2e} "
                f"{tps:,.0f} tok/s"
            )

    def eval(self, step: int, val: float, bpb: float) -> None:
        self.log(f"step {step}: val loss {val:.4f}, {bpb:.3f} bits/byte")
        self.record("eval", step, val_loss=val, val_bpb=bpb)
        if self.global_metrics:
            self.global_metrics.val_loss.set(val)
            self.global_metrics.val_bpb.set(bpb)

    def checkpoint(self, save) -> None:
        """A committed save (checkpoint/writer.py's SaveResult): `seconds` the whole save, of which the loop
        stood still `blocking_seconds` and `write_seconds` ran in the background."""
        how = f"loop blocked {save.blocking_seconds:.2f}s, " if save.write_seconds else ""
        self.log(
            f"checkpoint step {save.step} -> {save.path} ({save.bytes / 1e6:.1f} MB in {save.seconds:.2f}s, "
            f"{how}{save.reason})"
        )
        fields = ("seconds", "blocking_seconds", "write_seconds", "bytes", "reason")
        self.record(
            "checkpoint", save.step, path=str(save.path), **{key: getattr(save, key) for key in fields}
        )
        gauges = self.global_metrics
        if gauges is not None:
            gauges.ckpt_seconds.set(save.seconds)
            gauges.ckpt_step.set(save.step)
            gauges.ckpt_time.set(time.time())

    def stop_state(self, code: int) -> None:
        if self.global_metrics:
            self.global_metrics.stop_state.set(code)

    def close(self) -> None:
        self.close_progress()
        if self.trackers:
            self.trackers.close(self.exit_code)
        if self.metrics:
            self.metrics.close()
        if self.jsonl:
            self.jsonl.close()
