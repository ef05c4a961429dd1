"""The training loop: set up, step, evaluate, save, stop. The policy lives in the components under
app/trainer/ (schedule, stopping, checkpoint, budget link, report); this file wires them.

Run as `pretrain train ...` or, under torchrun, `torchrun --nproc-per-node N -m app.train ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.budget import BudgetExhausted
from app.config import Config
from app.data.loader import TrainLoader, fit_vocab, resolve_data_dir
from app.data.manifest import Manifest
from app.trainer import checkpoint as ckpt
from app.trainer.args import DESCRIPTION, add_arguments, config_from_args, print_config
from app.trainer.budget_link import BudgetLink
from app.trainer.evaluate import sample_text, validation_loss
from app.trainer.heartbeat import Heartbeat
from app.trainer.metrics import detect_gpu_type, flops_per_token, peak_flops
from app.trainer.model import GPT, count_parameters
from app.trainer.optim import build_optimizer, set_lr
from app.trainer.parallel import (
    DistEnv,
    all_reduce_mean,
    init_distributed,
    model_state_dict,
    optimizer_state_dict,
    shutdown_distributed,
    unwrap,
)
from app.trainer.report import Reporter
from app.trainer.restore import find_checkpoint, restore_weights, schedule_note
from app.trainer.rundir import check_fresh_start, move_run_aside
from app.trainer.runtime import autocast_for, grad_accum_steps, pick_device
from app.trainer.schedule import DecayPlan, lr_at
from app.trainer.spikes import SpikeDetector, spike_batch
from app.trainer.stopping import (
    BadSteps,
    EarlyStopping,
    PlannedEnd,
    SignalFlag,
    StopAgreement,
    StopCause,
    StopDecision,
    consume_stop_file,
)


@dataclass
class RunArgs:
    """Runtime choices that are not part of the model/training config."""

    out: Path
    resume: str = "auto"  # auto | never | PATH
    stop_file: Path | None = None
    overwrite: bool = False  # a fresh start in a used run dir moves the old run aside


@dataclass
class TrainerState:
    """Everything besides weights and optimizer that exact resume needs."""

    step: int = 0
    tokens: int = 0
    elapsed_seconds: float = 0.0  # training wall time over all restarts
    loader: dict = field(default_factory=dict)
    best_val_loss: float | None = None
    last_val_loss: float | None = None
    early_stopping: dict = field(default_factory=dict)
    spikes: dict = field(default_factory=dict)
    bad_steps: dict = field(default_factory=dict)
    budget_decay: dict | None = None  # DecayPlan once the budget started the decay
    spent_usd: float | None = None


class Trainer:
    def __init__(
        self,
        cfg: Config,
        args: RunArgs,
        env: DistEnv,
        device: torch.device,
        budget: BudgetLink,
        signals: SignalFlag,
    ) -> None:
        self.cfg, self.args, self.env, self.device, self.budget = cfg, args, env, device, budget
        self.signals = signals
        self.run_dir = Path(args.out)
        self.rank0 = env.is_rank0
        self.state = TrainerState()
        self.report: Reporter | None = None
        self.heartbeat = Heartbeat(self.run_dir, enabled=self.rank0)
        self.last_saved_step = -1
        self.step_seconds_avg = 0.0
        self.checkpoint_seconds = 0.0
        self.last_ckpt_time = time.monotonic()
        self.last_eval_step = -1
        self.resumed_saved_unix = 0.0

    def log(self, msg: str) -> None:
        if self.report is not None:
            self.report.log(msg)
        elif self.rank0:
            print(msg, flush=True)

    def warn(self, msg: str) -> None:
        if self.report is not None:
            self.report.warn(msg)
        elif self.rank0:
            print(msg, file=sys.stderr, flush=True)

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg, env = self.cfg, self.env
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.clean_temp_dirs(self.run_dir)
        env.barrier()
        gpu_type = cfg.metrics.gpu_type
        if not gpu_type and self.device.type == "cuda":
            gpu_type = detect_gpu_type(torch.cuda.get_device_name(self.device))
        self.peak = peak_flops(gpu_type, cfg.metrics.peak_tflops)
        # the reporter first: a busy metrics port fails here, before the data and the model
        self.report = Reporter(cfg, env, self.run_dir, with_mfu=bool(self.peak))
        self.data_dir = resolve_data_dir(cfg.data, self.log)
        self.manifest = Manifest.load(self.data_dir)
        fit_vocab(cfg.model, self.manifest, self.data_dir)
        self.accum = grad_accum_steps(cfg, env.world_size)
        self.tokens_per_step = self.accum * cfg.train.micro_batch_size * cfg.model.seq_len * env.world_size

        from app.trainer.memory import plan as plan_parallel
        from app.trainer.parallel import build_parallel_model

        torch.manual_seed(cfg.train.seed)
        self.parallel = plan_parallel(cfg, env.world_size, self.device)  # resolves train.parallel=auto
        est = self.parallel.fsdp if self.parallel.mode == "fsdp" else self.parallel.ddp
        self.log(f"parallel: {self.parallel.mode} ({self.parallel.reason}); estimate {est.describe()}")
        model = build_parallel_model(cfg, env, self.device, self.parallel.mode, self.log)
        self.counts = count_parameters(unwrap(model))
        self.optimizer = build_optimizer(unwrap(model), cfg.optim, self.device)
        t = cfg.train
        self.loader = TrainLoader(
            self.data_dir,
            cfg.model.seq_len,
            t.micro_batch_size,
            env.rank,
            env.world_size,
            t.seed,
            cfg.model.vocab_size,
        )
        self.early = EarlyStopping(cfg.train.early_stop_patience, cfg.train.early_stop_min_delta)
        self.spikes = SpikeDetector(cfg.train.spike_factor)
        self.bad_steps = BadSteps(cfg.train.max_bad_steps)
        self._maybe_resume(unwrap(model))
        self.model = torch.compile(model) if cfg.train.compile else model
        self.writer = ckpt.CheckpointWriter(self.run_dir, env.rank, env.world_size, env.barrier)
        self.autocast = autocast_for(cfg, self.device)

        self.flops_per_token = flops_per_token(cfg.model)
        self.report.throughput(self.flops_per_token, self.peak)

        self.stop_file = self.args.stop_file or self.run_dir / "stop.json"
        self.planned = PlannedEnd(cfg.train.max_steps, cfg.train.max_tokens, cfg.train.max_hours * 3600)
        self.stopper = StopAgreement(
            self.stop_file,
            self.planned,
            self.early,
            self.rank0,
            torch.device("cpu") if self.device.type == "cpu" else self.device,
            self.signals,
            self.bad_steps,
            warn=self.warn,
        )
        self.report.resumed(self.state.tokens, self.last_saved_step, self.resumed_saved_unix)
        self.report.info(
            {
                "preset": cfg.preset,
                "run": self.run_dir.name,
                "world_size": str(env.world_size),
                "parameters": str(self.counts.total),
                "non_embedding_parameters": str(self.counts.non_embedding),
            }
        )
        self._announce()

    def _maybe_resume(self, model: GPT) -> None:
        c = self.cfg.checkpoint
        info = find_checkpoint(self.run_dir, self.args.resume, c.verify, self.rank0, self.warn, self.log)
        if info is None:
            return
        restore_weights(model, self.optimizer, info, self.env, self.warn, self.log)
        self.state = TrainerState(**ckpt.load_trainer_state(info))
        st = self.state
        for part, saved in (
            (self.loader, st.loader),
            (self.early, st.early_stopping),
            (self.spikes, st.spikes),
            (self.bad_steps, st.bad_steps),
        ):
            if saved:
                part.load_state_dict(saved)
        self.last_saved_step = info.step if self.args.resume == "auto" else -1
        self.resumed_saved_unix = float(info.meta.get("saved_unix", 0.0))
        self.log(f"resumed from {ckpt.describe(info)}")
        if note := schedule_note(info, self.cfg, st.budget_decay):
            self.log(note)

    def _announce(self) -> None:
        cfg, env = self.cfg, self.env
        self.log(f"preset {cfg.preset}: {self.counts}")
        self.log(
            f"data {self.data_dir} (vocab {self.manifest.vocab_size}, "
            f"{sum(s.tokens for s in self.manifest.train):,} train tokens); device {self.device}, "
            f"world size {env.world_size}, {self.tokens_per_step:,} tokens/step "
            f"({cfg.train.micro_batch_size} x {cfg.model.seq_len} x {env.world_size} ranks x {self.accum} accum), "
            f"{self.flops_per_token / 1e6:.1f} MFLOPs/token"
        )
        self.report.event(
            "event",
            self.state.step,
            event="start",
            preset=cfg.preset,
            parameters=self.counts.total,
            non_embedding=self.counts.non_embedding,
            world_size=env.world_size,
            tokens_per_step=self.tokens_per_step,
        )

    # ------------------------------------------------------------ one step

    def train_step(self) -> dict:
        cfg, step = self.cfg, self.state.step
        t0 = time.perf_counter()
        decay = DecayPlan(**self.state.budget_decay) if self.state.budget_decay else None
        lr = lr_at(step, cfg.schedule, cfg.optim, cfg.train.max_steps, decay)
        set_lr(self.optimizer, lr)
        inject = (
            cfg.train.inject_spike_at_step
            and 0 <= step - cfg.train.inject_spike_at_step < cfg.train.spike_batches
        )
        loss_sum = torch.zeros((), device=self.device)
        loop_sums: list[torch.Tensor] = []
        data_wait = 0.0
        for micro in range(self.accum):
            td = time.perf_counter()
            x, y = self.loader.next()
            if inject:
                x, y = spike_batch(x, step * self.accum + micro, unwrap(self.model).cfg.vocab_size)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            data_wait += time.perf_counter() - td
            sync = micro == self.accum - 1 or not self.env.distributed
            with contextlib.nullcontext() if sync else self.model.no_sync(), self.autocast:
                out = self.model(x, y)
            (out.loss / self.accum).backward()
            loss_sum += out.loss.detach()
            for i, ll in enumerate(out.loop_losses):
                if len(loop_sums) <= i:
                    loop_sums.append(torch.zeros((), device=self.device))
                loop_sums[i] += ll
        loss = all_reduce_mean(loss_sum / self.accum, self.env).item()
        clip = cfg.optim.grad_clip or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        bad = self.bad_steps.update(math.isfinite(loss) and math.isfinite(grad_norm))
        if bad:
            self.warn(
                f"step {step}: loss {loss} / gradient norm {grad_norm} is not finite: update skipped "
                f"({self.bad_steps.in_a_row} in a row; the run stops at train.max_bad_steps={self.bad_steps.max_bad})"
            )
        spike = not bad and self.spikes.update(loss)
        if spike:
            self.log(
                f"loss spike at step {step}: {loss:.3f} vs moving average {self.spikes.avg:.3f}"
                + (" (update skipped)" if cfg.train.skip_spike_updates else "")
            )
        if not (bad or (spike and cfg.train.skip_spike_updates)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens += self.tokens_per_step
        dt = time.perf_counter() - t0
        self.step_seconds_avg = dt if self.step_seconds_avg == 0 else 0.9 * self.step_seconds_avg + 0.1 * dt
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_seconds": dt,
            "data_wait_seconds": data_wait,
            "spike": spike,
            "bad": bad,
            "injected": bool(inject),
            "loop_losses": [float(v) / self.accum for v in loop_sums],
        }

    # ------------------------------------------------------------ eval, sample, save

    def evaluate(self) -> None:
        cfg, st = self.cfg, self.state
        val, bpb = validation_loss(
            self.model,
            self.data_dir,
            cfg,
            self.env,
            self.device,
            self.autocast,
            self.manifest.bytes_per_token("val"),
        )
        st.last_val_loss = val
        if math.isfinite(val) and (st.best_val_loss is None or val < st.best_val_loss):
            st.best_val_loss = val
        self.early.update(val)
        self.last_eval_step = st.step
        self.report.eval(st.step, val, bpb)

    def planned_end_in(self, tokens_per_second: float) -> float:
        st = self.state
        return self.planned.seconds_left(
            st.step, st.tokens, st.elapsed_seconds, self.step_seconds_avg, tokens_per_second
        )

    def beat(self, state: str) -> None:
        st = self.state
        self.heartbeat.write(
            state, st.step, st.tokens, self.step_seconds_avg, self.checkpoint_seconds, self.last_saved_step
        )

    def save(self, reason: str) -> None:
        """Collective. Step 0 is never saved: nothing has been learned, and a restart from the seed is the
        same run (exact resume needs no checkpoint for it)."""
        st = self.state
        if st.step == 0:
            return
        st.loader = self.loader.state_dict()
        st.early_stopping = self.early.state_dict()
        st.spikes = self.spikes.state_dict()
        st.bad_steps = self.bad_steps.state_dict()
        st.spent_usd = self.budget.spent_usd(st.spent_usd)
        meta = {
            "config": self.cfg.to_dict(),
            "tokens": st.tokens,
            "val_loss": st.last_val_loss if self.last_eval_step == st.step else None,
            "best_val_loss": st.best_val_loss,
            "spent_usd": st.spent_usd,
            "reason": reason,
            "data": {"dir": str(self.data_dir), "tokenizer_sha256": self.manifest.tokenizer.get("sha256")},
        }
        self.beat("saving")
        result = self.writer.save(
            st.step,
            model_state_dict(self.model),
            optimizer_state_dict(self.model, self.optimizer),
            st.__dict__,
            meta,
            extra_files=[self.data_dir / "tokenizer.json"],
        )
        self.last_saved_step = st.step
        self.checkpoint_seconds = result.seconds
        self.last_ckpt_time = time.monotonic()
        if self.rank0:
            c = self.cfg.checkpoint
            ckpt.apply_retention(self.run_dir, c.keep_last, c.keep_best, c.drop_optimizer_older)
        self.report.checkpoint(st.step, result.path, result.seconds, result.bytes, reason)
        self.beat("running")

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        cfg, st = self.cfg, self.state
        self.report.open_progress(cfg.train.max_steps, st.step)
        self.beat("running")
        start = time.monotonic()
        elapsed_before = st.elapsed_seconds
        while True:
            now = time.monotonic()
            st.elapsed_seconds = elapsed_before + (now - start)
            due = (
                bool(cfg.checkpoint.every_minutes)
                and now - self.last_ckpt_time >= cfg.checkpoint.every_minutes * 60
            )
            proposal = self.budget.decay_proposal(st.step, self.step_seconds_avg, bool(st.budget_decay))
            decision, decay, save_now = self.stopper.agree(
                st.step, st.tokens, st.elapsed_seconds, proposal, due
            )
            if decision.cause != StopCause.NONE:
                break
            if st.step == 0 and cfg.train.eval_every and self.last_eval_step != 0:
                self.evaluate()  # after the first agreement: a stop during setup skips it
                self.report.reset_window()
            if decay and not st.budget_decay:
                st.budget_decay = {"start_step": st.step, "steps": decay}
                self.log(f"budget: starting the LR decay now, {decay} steps before the cap")
            if save_now and self.last_saved_step != st.step:
                self.save("every_minutes")
            m = self.train_step()
            self.report.step_done(st.step, self.tokens_per_step)
            if st.step % cfg.train.log_every == 0 or m["spike"] or m["bad"]:
                self.report.train(st.step, st.tokens, m, self.planned_end_in)
            if cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
                self.evaluate()
            if cfg.train.sample_every and st.step % cfg.train.sample_every == 0:
                # every rank: FSDP's forward gathers shards from all of them
                text = sample_text(self.model, self.data_dir, cfg.train.seed + st.step, self.device)
                self.log(f"sample at step {st.step}: {text!r}")
            if cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0:
                self.save("every_steps")
            if self.heartbeat.due():
                self.beat("running")
        return self._finish(decision)

    def _finish(self, decision: StopDecision) -> int:
        st = self.state
        self.report.close_progress()
        self.log(f"stopping at step {st.step}: {decision.reason}")
        self.report.stop_state(int(decision.cause))
        self.beat("stopping")
        if (
            decision.cause in (StopCause.PLANNED, StopCause.EARLY)
            and self.last_eval_step != st.step
            and self.cfg.train.eval_every
        ):
            self.evaluate()
        if decision.saves and self.last_saved_step != st.step:
            self.save(decision.name)
        self.report.event(
            "event",
            st.step,
            event="stop",
            cause=decision.name,
            reason=decision.reason,
            exit_code=decision.exit_code,
        )
        if self.rank0 and decision.cause in (StopCause.BUDGET, StopCause.IMMEDIATE):
            consume_stop_file(self.stop_file)
        self.beat("done" if decision.exit_code == 0 else "preempted")
        if self.rank0:
            for line in ckpt.summary(self.run_dir, self.cfg.checkpoint.verify, self.warn):
                self.log(line)
        return decision.exit_code

    def close(self) -> None:
        if self.report is not None:
            self.report.close()


def train(cfg: Config, args: RunArgs) -> int:
    # Signals are recorded from the start: a SIGTERM during setup (model build, resume, the data build) is
    # taken at the first stop agreement, by every rank at the same step, instead of killing one rank.
    signals = SignalFlag()
    signals.install()
    env = init_distributed("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    trainer = None
    budget = None
    try:
        device = pick_device(cfg, env.local_rank)
        if check_fresh_start(args.out, args.resume, args.overwrite):
            if env.is_rank0:
                move_run_aside(args.out, print)
            env.barrier()
        stop_file = args.stop_file or Path(args.out) / "stop.json"
        try:
            budget = BudgetLink(cfg, Path(args.out), stop_file, env.is_rank0, env.world_size)
        except BudgetExhausted as e:
            if env.is_rank0:
                print(f"budget already spent, nothing to do: {e}", flush=True)
                Path(args.out).mkdir(parents=True, exist_ok=True)
                Heartbeat(Path(args.out)).write("done")  # tells a sidecar watcher we are done
            return 0
        trainer = Trainer(cfg, args, env, device, budget, signals)
        trainer.setup()
        return trainer.run()
    except BaseException:
        if trainer is not None:  # the watcher must not go on reading "running" from a dead trainer
            with contextlib.suppress(Exception):
                trainer.beat("failed")
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if budget is not None:
            budget.close()
        signals.uninstall()
        shutdown_distributed()


def run(args: argparse.Namespace) -> int:
    """`pretrain train`: resolve the config, then print it or train."""
    cfg = config_from_args(args)
    if args.print_config:
        return print_config(cfg)
    stop_file = Path(args.stop_file) if args.stop_file else None
    out = Path(args.out or f"runs/{cfg.preset}")
    return train(cfg, RunArgs(out, args.resume, stop_file, args.overwrite))


def main(argv: list[str] | None = None) -> int:
    from app.command import main_for

    return main_for("pretrain train", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
