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

from app.budget import BudgetExhausted, PriceAboveMax
from app.config import Config
from app.data.loader import Prefetcher, TrainLoader, fit_vocab, resolve_data_dir
from app.data.manifest import Manifest
from app.trainer import checkpoint as ckpt
from app.trainer.args import DESCRIPTION, add_arguments, config_from_args, print_config
from app.trainer.budget_link import BudgetLink
from app.trainer.checkpoint_writer import CheckpointWriter, SaveResult
from app.trainer.evaluate import sample_text, validation_loss
from app.trainer.heartbeat import Heartbeat
from app.trainer.lease import hold_run_dir, release
from app.trainer.metrics import device_peak, flops_per_token
from app.trainer.model import GPT, count_parameters
from app.trainer.optim import build_optimizer, set_lr
from app.trainer.parallel import DistEnv, init_distributed, shutdown_distributed, unwrap
from app.trainer.report import Reporter
from app.trainer.restore import find_checkpoint, restore_weights, schedule_note
from app.trainer.rundir import check_fresh_start, move_run_aside
from app.trainer.runtime import autocast_for, configure_device, grad_accum_steps, pick_device
from app.trainer.schedule import DecayPlan, lr_at
from app.trainer.spikes import SpikeDetector, spike_batch
from app.trainer.step import StepLog, StepReader, TrainStep
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
        self.steplog = StepLog(env)
        self.last_save: SaveResult | None = None  # its timings go to the heartbeat
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
        configure_device(self.device)
        _, self.peak = device_peak(cfg.metrics.gpu_type, cfg.metrics.peak_tflops, self.device)
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
        self.reader = StepReader(self.steplog, self.bad_steps, self.spikes, self.report, cfg.train)
        self._maybe_resume(unwrap(model))
        self.model = model
        self.writer = CheckpointWriter(self.run_dir, env.rank, env.world_size, env.barrier, cfg.checkpoint)
        self.autocast = autocast_for(cfg, self.device)
        self.batches = Prefetcher(self.loader, self.device, t.prefetch)  # after resume: from its position
        self.step = TrainStep(
            model,
            self.optimizer,
            self.batches,
            self.accum,
            self.autocast,
            env,
            cfg.optim.grad_clip,
            self.steplog,
        )

        self.flops_per_token = flops_per_token(cfg.model)
        self.report.throughput(self.flops_per_token, self.peak)

        self.stop_file = self.args.stop_file or self.run_dir / "stop.json"
        self.planned = PlannedEnd(cfg.train.max_steps, cfg.train.max_tokens, cfg.train.max_hours * 3600)
        self.stopper = StopAgreement(
            self.stop_file,
            self.planned,
            self.early,
            self.rank0,
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
        info = find_checkpoint(self.run_dir, self.args.resume, c.verify, self.env, self.warn, self.log)
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

    def train_step(self) -> None:
        """One optimizer step; its numbers stay on the device until read_steps (app/trainer/step.py)."""
        t, st = self.cfg.train, self.state
        decay = DecayPlan(**st.budget_decay) if st.budget_decay else None
        lr = lr_at(st.step, self.cfg.schedule, self.cfg.optim, t.max_steps, decay)
        set_lr(self.optimizer, lr)
        inject = bool(t.inject_spike_at_step) and 0 <= st.step - t.inject_spike_at_step < t.spike_batches
        vocab = unwrap(self.model).cfg.vocab_size
        replace = (
            (lambda x, y, micro: spike_batch(x, st.step * self.accum + micro, vocab)) if inject else None
        )
        # skip_spike_updates decides on the host, before the update: the one case that reads every step
        decide = (lambda: float(any(self.read_steps()))) if t.skip_spike_updates else None
        self.reader.note(st.step + 1, lr, inject)
        self.reader.waited(self.step(st.step + 1, replace, decide))
        st.step += 1
        st.tokens += self.tokens_per_step

    def read_steps(self) -> tuple[bool, bool]:
        """Collective: the step log's numbers to the guards and the reporter; (bad, spike) of the last step."""
        st = self.state
        return self.reader.read(st.step, st.tokens, self.tokens_per_step, self.planned_end_in)

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
            st.step, st.tokens, st.elapsed_seconds, self.reader.step_seconds, tokens_per_second
        )

    def beat(self, state: str) -> None:
        st = self.state
        self.heartbeat.write(
            state, st.step, st.tokens, self.reader.step_seconds, self.last_saved_step, self.last_save
        )

    def save(self, reason: str, final: bool = False) -> None:
        """Collective; in the background unless `final` (a stop). Step 0 is never saved: nothing has been
        learned, and a restart from the seed is the same run (exact resume needs no checkpoint for it)."""
        st = self.state
        if st.step == 0:
            return
        self.read_steps()  # the guards' state goes into the checkpoint
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
        self.saved(self.writer.wait())  # the previous background save, if one is still running
        self.beat("saving")
        files = [self.data_dir / "tokenizer.json"]  # a checkpoint dir alone is enough to sample or export
        result = self.writer.save(
            st.step, self.model, self.optimizer, st.__dict__, meta, files, reason, final
        )
        self.last_saved_step = st.step
        self.last_ckpt_time = time.monotonic()
        self.saved(result)
        self.beat("running")

    def saved(self, r: SaveResult | None) -> None:
        """Report a save once it is committed (at once when synchronous, later from the background)."""
        if r is not None:
            self.last_save = r
            self.report.checkpoint(r)

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
            proposal = self.budget.decay_proposal(st.step, self.reader.step_seconds, bool(st.budget_decay))
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
            self.train_step()
            self.report.step_done(st.step, self.tokens_per_step)
            if st.step % cfg.train.log_every == 0:
                self.read_steps()
            if cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
                self.evaluate()
            if cfg.train.sample_every and st.step % cfg.train.sample_every == 0:
                # every rank: FSDP's forward gathers shards from all of them
                text = sample_text(
                    self.model,
                    self.data_dir,
                    cfg.train.seed + st.step,
                    self.device,
                    self.parallel.mode == "fsdp",
                )
                self.log(f"sample at step {st.step}: {text!r}")
            if cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0:
                self.save("every_steps")
            self.saved(self.writer.poll())
            if self.heartbeat.due():
                self.beat("running")
        return self._finish(decision)

    def _finish(self, decision: StopDecision) -> int:
        st = self.state
        self.read_steps()
        self.report.close_progress()
        self.log(f"stopping at step {st.step}: {decision.reason}")
        self.report.stop_state(decision.gauge_code)
        self.beat("stopping")
        if (
            decision.cause in (StopCause.PLANNED, StopCause.EARLY)
            and self.last_eval_step != st.step
            and self.cfg.train.eval_every
        ):
            self.evaluate()
        if decision.saves and self.last_saved_step != st.step:
            self.save(decision.name, final=True)
        if decision.saves:
            self.saved(self.writer.wait())  # a stop ends on a complete, committed checkpoint
        else:
            self.writer.abandon()  # immediate: exit now; a pending write stays an uncommitted temp dir
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
        if hasattr(self, "batches"):
            self.batches.close()
        if hasattr(self, "writer"):
            self.writer.abandon()  # still pending only after a crash: the last committed checkpoint stands
        if self.report is not None:
            self.report.close()


def train(cfg: Config, args: RunArgs) -> int:
    # Signals are recorded from the start: a SIGTERM during setup (model build, resume, the data build) is
    # taken at the first stop agreement, by every rank at the same step, instead of killing one rank.
    signals = SignalFlag()
    signals.install()
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    env = init_distributed("cuda" if cuda else "cpu", cfg.train.collective_timeout_minutes)
    trainer = None
    budget = None
    lease = None
    try:
        lease = hold_run_dir(Path(args.out), cfg.checkpoint, signals, env.is_rank0)  # one writer per run dir
        device = pick_device(cfg, env.local_rank)
        if check_fresh_start(args.out, args.resume, args.overwrite):
            if env.is_rank0:
                move_run_aside(args.out, print)
            env.barrier()
        stop_file = args.stop_file or Path(args.out) / "stop.json"
        try:
            budget = BudgetLink(cfg, Path(args.out), stop_file, env.is_rank0, env.world_size)
        except (BudgetExhausted, PriceAboveMax) as e:  # a deliberate end before any work: exit 0
            if env.is_rank0:
                spent = isinstance(e, BudgetExhausted)
                print(f"{'budget already spent, nothing to do' if spent else 'price guard'}: {e}", flush=True)
                Path(args.out).mkdir(parents=True, exist_ok=True)
                Heartbeat(Path(args.out)).write("done")  # tells a sidecar watcher we are done
            return 0
        trainer = Trainer(cfg, args, env, device, budget, signals)
        trainer.setup()
        return trainer.run()
    except BaseException:
        # the watcher must not go on reading "running" from a dead trainer
        with contextlib.suppress(Exception):
            if trainer is not None:
                trainer.beat("failed")
            elif env.is_rank0:
                Heartbeat(Path(args.out)).fail_if_written()
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if budget is not None:
            budget.close()
        release(lease)
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
