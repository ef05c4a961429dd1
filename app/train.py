"""The training loop. `train_step` is the algorithm: get a batch, forward, backward, clip, update. The
`Trainer` holds one run's state and runs the step until the ranks agree to stop; each component it calls
decides itself whether its time has come (evaluate, sample, save, stop). What each component does:
docs/architecture.md ("The training step").

Run as `pretrain train ...` or, under torchrun, `torchrun --nproc-per-node N -m app.train ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.budget import BudgetExhausted, PriceAboveMax
from app.config import Config
from app.data.loader import fit_vocab, resolve_data_dir
from app.data.manifest import Manifest
from app.errors import UserError
from app.trainer import distributed as peers
from app.trainer import layout, rundir, stopping
from app.trainer.args import DESCRIPTION, RunArgs, add_arguments, config_from_args, print_config
from app.trainer.batches import TrainBatches
from app.trainer.budget_link import BudgetLink
from app.trainer.checkpoint import Checkpointer, TrainerState
from app.trainer.distributed import DistEnv, init_distributed, shutdown_distributed
from app.trainer.evaluate import Evaluator, Sampler
from app.trainer.heartbeat import Heartbeat
from app.trainer.lease import hold_run_dir, release
from app.trainer.metrics import device_peak, flops_per_token
from app.trainer.model import count_parameters
from app.trainer.optim import build_optimizer, set_lr, set_muon_momentum, step_unless
from app.trainer.parallelize import clip_grad_norm, grad_sync, unwrap
from app.trainer.planned_end import PlannedEnd
from app.trainer.report import Reporter
from app.trainer.runtime import autocast_for, configure_device, pick_device
from app.trainer.schedule import muon_momentum_at
from app.trainer.spikes import SpikeDetector
from app.trainer.steplog import StepLog
from app.trainer.stop_causes import StopDecision
from app.trainer.stopping import (
    Agreement,
    BadSteps,
    EarlyStopping,
    MfuFloor,
    SignalFlag,
    StopAgreement,
)


def train_step(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches,
    accum: int,
    autocast,
    grad_clip: float,
    step: int,
    lr: float,
    log: StepLog,
    skip_update: Callable[[], bool] | None = None,
) -> None:
    """Optimizer step number `step` (1-based) over `accum` micro-batches from `batches.next()`. Nothing here
    reads a number back from the device: the losses and the gradient norm go to `log`, and a step whose
    gradient is not finite is skipped on the device. `skip_update` (train.skip_spike_updates) decides on
    the host instead."""
    set_lr(optimizer, lr)
    losses = None
    for micro in range(accum):
        inputs, targets = batches.next()
        # gradients are synchronised between ranks on the last micro-batch only
        with grad_sync(model, last_micro_batch=micro == accum - 1), autocast:
            out = model(inputs, targets)
        (out.loss / accum).backward()
        micro_losses = torch.stack([out.loss.detach(), *out.loop_losses])
        losses = micro_losses if losses is None else losses + micro_losses
    grad_norm = clip_grad_norm(model, grad_clip or float("inf"))
    log.add(step, lr, losses / accum, grad_norm)
    skip = ~torch.isfinite(grad_norm)  # the norm is global: every rank takes the same decision
    if skip_update is not None:
        skip = torch.tensor(skip_update(), device=grad_norm.device)
    step_unless(optimizer, skip.float())
    optimizer.zero_grad(set_to_none=True)


class Trainer:
    """One run: its state (`state`, saved in every checkpoint), the model and optimizer, and the
    components that act on them, each built once in `setup`."""

    def __init__(self, cfg: Config, budget: BudgetLink, heartbeat: Heartbeat) -> None:
        self.cfg = cfg
        self.budget = budget  # spend, the budget's LR decay, the trainer's own Kubernetes Events
        self.heartbeat = heartbeat  # what the budget watcher reads of the run (app/trainer/heartbeat.py)
        self.state = TrainerState()
        # built by setup():
        #   model, optimizer        what trains
        #   data                    the micro-batches (app/trainer/batches.py)
        #   autocast, steplog       the step's precision; the numbers each step leaves on the device
        #   report                  console, metrics.jsonl, Prometheus, trackers
        #   spikes                  the loss-spike detector
        #   stopper                 the stop causes and the agreement of the ranks
        #   checkpointer            resume, save when due, the stop's save
        #   evaluator, sampler      val loss every train.eval_every, a sample every train.sample_every

    def setup(self, *, run: RunArgs, env: DistEnv, device: torch.device, signals: SignalFlag) -> None:
        """Build the components, each once, in the order their inputs exist. Collective."""
        cfg = self.cfg
        train = cfg.train
        run_dir = Path(run.out)
        configure_device(device)
        _, peak = device_peak(cfg.metrics.gpu_type, cfg.metrics.peak_tflops, device)
        if train.mfu_floor and not peak:
            raise UserError(
                f"train.mfu_floor needs the device's peak to measure MFU, and {device.type} "
                "has none: set --gpu-type or metrics.peak_tflops, or drop train.mfu_floor"
            )
        self.report = Reporter(cfg, env, run_dir, peak)  # first: a busy port fails before the data
        log = self.report.log
        warn = self.report.warn
        data_dir = resolve_data_dir(cfg.data, log)
        manifest = Manifest.load(data_dir)
        fit_vocab(cfg.model, manifest, data_dir)

        from app.trainer.memory import checkpoint_bytes, plan_for_training
        from app.trainer.parallelize import build_parallel_model

        self.checkpointer = Checkpointer(
            run_dir,
            cfg,
            env,
            resume=run.resume,
            data={"dir": str(data_dir), "tokenizer_sha256": manifest.tokenizer.get("sha256")},
            files=[data_dir / "tokenizer.json"],  # a checkpoint dir alone is enough to sample or export
            expect_bytes=checkpoint_bytes(cfg),
            log=log,
            warn=warn,
            on_commit=self.report.checkpoint,
            on_save=self.beat,
        )
        resume_from = self.checkpointer.find()
        auto_micro_batch = layout.for_run(cfg, env.world_size, device, resume_from, run_dir, log)

        torch.manual_seed(train.seed)
        parallel = plan_for_training(cfg, env.world_size, device)  # resolves train.parallel=auto
        estimate = parallel.fsdp if parallel.mode == "fsdp" else parallel.ddp
        log(f"parallel: {parallel.mode} ({parallel.reason}); estimate {estimate.describe()}")
        self.model = build_parallel_model(cfg, env, device, parallel.mode, log)
        counts = count_parameters(unwrap(self.model))
        self.optimizer = build_optimizer(unwrap(self.model), cfg.optim, device)
        self.data = TrainBatches(
            cfg, env, data_dir, device, auto_micro_batch=auto_micro_batch, run_dir=run_dir, log=log, warn=warn
        )
        early = EarlyStopping(patience=train.early_stop_patience, min_delta=train.early_stop_min_delta)
        self.spikes = SpikeDetector(factor=train.spike_factor)
        bad_steps = BadSteps(max_bad=train.max_bad_steps)

        self.state = self.checkpointer.load(self.model, self.optimizer)
        resumed_parts = [
            (self.data, self.state.loader),
            (early, self.state.early_stopping),
            (self.spikes, self.state.spikes),
            (bad_steps, self.state.bad_steps),
        ]
        for part, saved in resumed_parts:
            if saved:
                part.load_state_dict(saved)
        self.data.start(self.state.step)  # reads ahead from the resumed position

        self.autocast = autocast_for(cfg, device)
        self.steplog = StepLog(env)
        stop_file = run.stop_file or run_dir / "stop.json"
        planned = PlannedEnd.of(cfg, self.data.tokens_per_step, self.state.budget_decay)
        dropped = planned.drop_outdated(self.state.step, self.state.tokens, cfg.schedule, cfg.optim)
        if dropped:  # resumed with another max_hours: the end is planned again
            log(dropped)
            self.state.budget_decay = None
        self.stopper = StopAgreement(
            stop_file=stop_file if env.is_rank0 else None,  # only the master pod's
            planned=planned,
            early=early,
            signals=signals,
            bad_steps=bad_steps,
            mfu_floor=MfuFloor(train.mfu_floor, train.mfu_floor_minutes),
            every=train.stop_check_every,
            say=log,
            warn=warn,
        )
        self.evaluator = Evaluator(
            self.model,
            cfg,
            env,
            device,
            self.autocast,
            data_dir=data_dir,
            bytes_per_token=manifest.bytes_per_token("val"),
            early=early,
            report=self.report,
        )
        self.sampler = Sampler(
            self.model,
            data_dir,
            device,
            seed=train.seed,
            every=train.sample_every,
            fsdp=parallel.mode == "fsdp",  # every rank draws: FSDP gathers
            log=log,
        )

        flops = flops_per_token(cfg.model)
        self.report.started(
            counts=counts,
            flops_per_token=flops,
            tokens=self.state.tokens,
            checkpoint=self.checkpointer.resumed(),
        )
        tokens_per_step = self.data.tokens_per_step
        log(
            f"data {data_dir} (vocab {manifest.vocab_size}, "
            f"{sum(shard.tokens for shard in manifest.train):,} train tokens); device {device}, "
            f"world size {env.world_size}, {tokens_per_step:,} tokens/step ({train.micro_batch_size} x "
            f"{cfg.model.seq_len} x {env.world_size} ranks x {self.data.accum} accum), "
            f"{flops / 1e6:.1f} MFLOPs/token"
        )
        self.report.event(
            "event",
            self.state.step,
            event="start",
            preset=cfg.preset,
            parameters=counts.total,
            non_embedding=counts.non_embedding,
            world_size=env.world_size,
            tokens_per_step=tokens_per_step,
        )

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        state = self.state
        self.report.open_progress(self.cfg.train.max_steps, state.step)
        self.beat("running")
        started = time.monotonic() - state.elapsed_seconds  # the run's clock, over all restarts
        while True:
            state.elapsed_seconds = time.monotonic() - started
            agreed = self.agree()
            if agreed.decision.stops:
                break
            if state.step == 0 and self.evaluator.due(0):
                # the untrained model's loss, after the first agreement: a stop during setup skips it
                self.evaluator.maybe_evaluate(state)
                self.report.reset_window()
            self.follow_plan(agreed.plan)
            self.checkpointer.maybe_save(state.step, self.snapshot, time_agreed=agreed.save_now)

            if not self.step():
                continue  # out of memory early under micro_batch_size=auto: the same step, smaller

            if state.step % self.cfg.train.log_every == 0:
                self.read_step_log()
            last = self.stopper.ends_at(state.step, state.tokens)
            self.evaluator.maybe_evaluate(state, last=last)  # the last step's eval comes before its save
            self.sampler.maybe_sample(state.step)
            self.checkpointer.maybe_save(state.step, self.snapshot)
            if self.heartbeat.due():
                self.beat("running")
        return self.finish(agreed.decision)

    def agree(self) -> Agreement:
        """Every rank's stop causes, the budget's decay proposal and the time for a save, agreed by all
        ranks (every train.stop_check_every steps; at the other steps only what all ranks see alike)."""
        state = self.state
        pace = self.report.step_seconds
        decay = self.budget.decay_proposal(state.step, pace, bool(state.budget_decay))
        return self.stopper.agree(
            state.step, state.tokens, state.elapsed_seconds, decay, self.checkpointer.time_due(), pace
        )

    def follow_plan(self, plan: dict | None) -> None:
        """An end plan the ranks just agreed (the budget's LR decay, or where max_hours ends), once: from
        now on it is part of the state, and the LR schedule and the planned end follow it."""
        state = self.state
        planned = self.stopper.planned
        if plan and not state.budget_decay:
            # the planned curve starts at the LR this step runs at without it, so the LR does not jump;
            # stored with the plan, so a resume follows the same curve
            plan["start_lr"] = planned.lr(state.step, state.tokens, self.cfg.schedule, self.cfg.optim)
            state.budget_decay = plan
            self.report.log(planned.follow(plan))

    def step(self) -> bool:
        """One optimizer step; False when it ran out of memory in this process's first steps under
        train.micro_batch_size=auto and is to be retried at half the micro-batch."""
        cfg = self.cfg
        state = self.state
        state.lr = self.stopper.planned.lr(state.step, state.tokens, cfg.schedule, cfg.optim)
        annealed = self.stopper.planned.annealed(state.step, state.tokens, cfg.schedule, cfg.optim)
        set_muon_momentum(self.optimizer, muon_momentum_at(state.step, annealed, cfg.optim))
        skip_spikes = self.skip_if_spike if cfg.train.skip_spike_updates else None
        first_micro = self.data.micro_steps
        try:
            train_step(
                model=self.model,
                optimizer=self.optimizer,
                batches=self.data,
                accum=self.data.accum,
                autocast=self.autocast,
                grad_clip=cfg.optim.grad_clip,
                step=state.step + 1,
                lr=state.lr,
                log=self.steplog,
                skip_update=skip_spikes,
            )
        except torch.OutOfMemoryError as error:
            self.data.retry_smaller(error, state.step, first_micro)  # raises unless it is the layout's
            self.optimizer.zero_grad(set_to_none=True)
            self.steplog.discard(state.step + 1)
            return False
        state.step += 1
        peers.at_step(state.step)  # named if a peer is lost
        state.tokens += self.data.tokens_per_step
        self.report.step_done(state.step, self.data.tokens_per_step)
        return True

    def read_step_log(self) -> tuple[bool, bool]:
        """Collective: the steps logged since the last read go, in order, through the divergence guard and
        the spike detector to the reporter. Returns (bad, spike) of the last step."""
        rows = self.steplog.read()
        if not rows:
            return False, False
        state = self.state
        train = self.cfg.train
        tokens_per_second, step_seconds = self.report.window()
        self.stopper.mfu_floor.update(self.report.mfu(tokens_per_second), time.monotonic())
        data_wait = self.data.take_wait_seconds() / len(rows)
        planned_in = self.stopper.planned.seconds_left(
            state.step, state.tokens, state.elapsed_seconds, self.report.step_seconds, tokens_per_second
        )
        bad_steps = self.stopper.bad_steps
        bad = spike = False
        for row in rows:
            bad = bad_steps.update(row.finite)  # the device skipped this update exactly when not finite
            spike = not bad and self.spikes.update(row.loss)
            self.report.guards(row, bad, spike, bad_steps, self.spikes, train.skip_spike_updates)
            if row.step % train.log_every == 0 or spike or bad:
                self.report.train(
                    row,
                    tokens=state.tokens - (state.step - row.step) * self.data.tokens_per_step,
                    tokens_per_second=tokens_per_second,
                    step_seconds=step_seconds,
                    data_wait_seconds=data_wait,
                    spike=spike,
                    bad=bad,
                    injected=self.data.injected(row.step),
                    seconds_to_planned_end=planned_in,
                )
        return bad, spike

    def skip_if_spike(self) -> bool:
        """train.skip_spike_updates: read this step's loss now (a host sync every step, by choice)."""
        return any(self.read_step_log())

    def snapshot(self) -> tuple[TrainerState, dict]:
        """Collective: what a checkpoint holds besides the weights and the optimizer. The state exact
        resume needs (each component's own, after reading the step log into the guards), and the
        progress meta.json records."""
        self.read_step_log()
        state = self.state
        state.loader = self.data.state_dict()
        state.early_stopping = self.stopper.early.state_dict()
        state.spikes = self.spikes.state_dict()
        state.bad_steps = self.stopper.bad_steps.state_dict()
        state.spent_usd = self.budget.spent_usd(state.spent_usd)
        evaluated_now = self.evaluator.last_step == state.step
        progress = {
            "tokens": state.tokens,
            "val_loss": state.last_val_loss if evaluated_now else None,
            "best_val_loss": state.best_val_loss,
            "spent_usd": state.spent_usd,
        }
        return state, progress

    def beat(self, status: str) -> None:
        """The heartbeat the budget watcher reads: running | saving | stopping | done | preempted | failed."""
        state = self.state
        self.heartbeat.write(
            status,
            state.step,
            state.tokens,
            self.report.step_seconds,
            self.checkpointer.committed_step,
            self.checkpointer.committed,
        )

    def failed(self) -> None:
        """The heartbeat says "failed": the watcher must not go on reading "running" from a dead trainer."""
        if hasattr(self, "checkpointer"):
            self.beat("failed")
        else:  # setup failed early
            self.heartbeat.write("failed", self.state.step, self.state.tokens)

    # ------------------------------------------------------------ the stop

    def finish(self, decision: StopDecision) -> int:
        """Every rank, at the same step. A graceful stop evaluates (a planned or early end), saves and
        waits until the save is committed; an immediate stop abandons a save still being written."""
        state = self.state
        self.read_step_log()
        self.report.close_progress()
        self.report.log(f"stopping at step {state.step}: {decision.reason}")
        self.report.stop_state(decision.gauge_code)
        self.beat("stopping")
        if decision.planned_or_early:
            self.evaluator.maybe_evaluate(state, last=True)
        if decision.saves:
            self.checkpointer.final_save(state.step, self.snapshot, decision.name)
        else:
            self.checkpointer.abandon()  # its temp dir is removed; the last committed checkpoint stands
        self.report.event(
            "event",
            state.step,
            event="stop",
            cause=decision.name,
            reason=decision.reason,
            exit_code=decision.exit_code,
        )
        if decision.consumes_stop_file:
            self.stopper.consume_stop_file()
        if decision.event:  # posted here, or relayed by the watcher from the heartbeat
            posted = self.budget.event(decision.event, decision.reason, self.report.warn)
            self.heartbeat.event = {"reason": decision.event, "message": decision.reason, "posted": posted}
        self.beat("done" if decision.exit_code == 0 else "preempted")
        for line in self.checkpointer.summary():
            self.report.log(line)
        return decision.exit_code

    def close(self) -> None:
        """What setup built, however far it got."""
        if hasattr(self, "data"):
            self.data.close()
        if hasattr(self, "checkpointer"):
            self.checkpointer.abandon()  # pending only after a crash: the last committed checkpoint stands
        if hasattr(self, "report"):
            self.report.close()


def train(cfg: Config, run: RunArgs) -> int:
    # Signals are recorded from the start: a SIGTERM during setup (model build, resume, the data build) is
    # taken at the first stop agreement, by every rank at the same step, instead of killing one rank.
    signals = SignalFlag()
    signals.install()
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    env = init_distributed("cuda" if cuda else "cpu", cfg.train.collective_timeout_minutes)
    run_dir = Path(run.out)
    trainer = None
    budget = None
    lease = None
    try:
        lease = hold_run_dir(run_dir, cfg.checkpoint, signals, env.is_rank0)  # one writer per run dir
        device = pick_device(cfg, env.local_rank)
        rundir.prepare(run_dir, run.resume, run.overwrite, env)
        stop_file = run.stop_file or run_dir / "stop.json"
        try:
            budget = BudgetLink(cfg, run_dir, stop_file, env.is_rank0, env.world_size)
        except (BudgetExhausted, PriceAboveMax) as end:  # a deliberate end before any work: exit 0
            if env.is_rank0:
                what = (
                    "budget already spent, nothing to do"
                    if isinstance(end, BudgetExhausted)
                    else "price guard"
                )
                print(f"{what}: {end}", flush=True)
                Heartbeat(run_dir).write("done")  # tells a sidecar watcher we are done
            return 0
        trainer = Trainer(cfg, budget, Heartbeat(run_dir, enabled=env.is_rank0))
        trainer.setup(run=run, env=env, device=device, signals=signals)
        return trainer.run()
    except BaseException as error:
        peers.exit_if_peer_lost(error)  # a collective failed because a peer is gone: exit 144 (retried)
        # the watcher must not go on reading "running" from a dead trainer
        with contextlib.suppress(Exception):
            if trainer is not None:
                trainer.failed()
            elif env.is_rank0:
                Heartbeat(run_dir).fail_if_written()
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
    stopping.check_stop_file(stop_file, out)
    return train(cfg, RunArgs(out, args.resume, stop_file, args.overwrite))


def main(argv: list[str] | None = None) -> int:
    from app.command import main_for

    return main_for("pretrain train", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
