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
from dataclasses import dataclass
from pathlib import Path

import torch

from app.budget import BudgetExhausted, PriceAboveMax
from app.config import Config
from app.data.loader import fit_vocab, resolve_data_dir
from app.data.manifest import Manifest
from app.files import stop_file_of
from app.trainer import rundir, startup
from app.trainer.args import DESCRIPTION, RunArgs, add_arguments, config_from_args, plan_run, print_config
from app.trainer.checkpoint import TrainerState
from app.trainer.model.gpt import count_parameters
from app.trainer.optimization.optimizer import build_optimizer, set_lr, set_muon_momentum, step_unless
from app.trainer.parallel import layout
from app.trainer.parallel.batches import TrainBatches
from app.trainer.parallel.distributed import (
    DistEnv,
    at_step,
    exit_if_peer_lost,
    init_distributed,
    shutdown_distributed,
)
from app.trainer.parallel.parallelize import clip_grad_norm, grad_sync, unwrap
from app.trainer.parallel.runtime import autocast_for, configure_device, pick_device
from app.trainer.reporting.metrics import flops_per_token
from app.trainer.reporting.steplog import StepLog
from app.trainer.stopping import agreement as stopping
from app.trainer.stopping.agreement import Agreement, BadSteps, EarlyStopping, SignalFlag
from app.trainer.stopping.budget_link import BudgetLink
from app.trainer.stopping.causes import StopDecision
from app.trainer.stopping.heartbeat import Heartbeat
from app.trainer.stopping.lease import hold_run_dir, release
from app.trainer.stopping.planned_end import DecayPlan
from app.trainer.stopping.spikes import SpikeDetector


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


@dataclass(frozen=True)
class StepVerdict:
    """What the divergence guard and the spike detector found in the newest step read from the step log."""

    bad: bool = False  # its loss or gradient norm is not finite (the device skipped its update)
    spike: bool = False  # its loss spiked (app/trainer/stopping/spikes.py)

    @property
    def skip(self) -> bool:
        """train.skip_spike_updates: whether the step's update is skipped."""
        return self.bad or self.spike


class Trainer:
    """One run: its state (`state`, saved in every checkpoint), the model and optimizer, and the components
    that act on them, each built once in `__init__`, so the trainer is whole before its loop starts. `run`
    is the loop, `step` one optimizer step, `finish` the stop, `snapshot` what a save holds."""

    def __init__(
        self,
        cfg: Config,
        budget: BudgetLink,
        *,
        run: RunArgs,
        stop_file: Path,
        env: DistEnv,
        device: torch.device,
        signals: SignalFlag,
        closing: contextlib.ExitStack,
    ) -> None:
        """Build the components, each once, in the order their inputs exist. Collective. What holds
        something open goes on `closing` as soon as it is built, so a start that fails half-way closes what
        it built, and the end of a run closes the data, then the checkpoints, then the reporter."""
        train = cfg.train
        run_dir = Path(run.out)
        self.cfg = cfg
        self.budget = budget  # spend, the budget's LR decay, the watcher's heartbeat, Kubernetes Events
        configure_device(device)
        self.report = startup.reporter(cfg, env, run_dir, device)  # first: a busy port fails before the data
        closing.callback(self.report.close)
        log = self.report.log
        data_dir = resolve_data_dir(cfg.data, log)
        manifest = Manifest.load(data_dir)
        fit_vocab(cfg.model, manifest, data_dir)
        self.checkpointer = startup.checkpointer(cfg, env, run, data_dir, manifest, self.report, self.beat)
        # a pending save is abandoned only after a crash: the last committed checkpoint stands
        closing.callback(self.checkpointer.abandon)
        auto = layout.for_run(cfg, env.world_size, device, self.checkpointer.find(), run_dir, log)

        self.model, parallel = startup.parallel_model(cfg, env, device, log)
        self.optimizer = build_optimizer(unwrap(self.model), cfg.optim, device)
        self.data = TrainBatches(
            cfg, env, data_dir, device, auto_micro_batch=auto, run_dir=run_dir, log=log, warn=self.report.warn
        )
        closing.callback(self.data.close)
        early = EarlyStopping(patience=train.early_stop_patience, min_delta=train.early_stop_min_delta)
        self.spikes = SpikeDetector(factor=train.spike_factor)
        bad_steps = BadSteps(max_bad=train.max_bad_steps)
        self.state = self.checkpointer.load(self.model, self.optimizer)
        startup.resume_parts(self.state, self.data, early, self.spikes, bad_steps)

        self.autocast = autocast_for(cfg, device)
        self.steplog = StepLog(env)
        self.schedule = startup.schedule(cfg, self.state, self.data.tokens_per_step, log)
        self.stopper = startup.stop_agreement(
            cfg, env, stop_file, self.schedule.end, early, bad_steps, signals, self.report
        )
        fsdp = parallel.mode == "fsdp"
        self.evaluator, self.sampler = startup.evaluation(
            cfg, env, device, self.model, self.autocast, data_dir, manifest, early, self.report, fsdp
        )
        self.announce(env, device, data_dir, manifest)

    def announce(self, env: DistEnv, device: torch.device, data_dir: Path, manifest: Manifest) -> None:
        """What runs: the model's size, the data, the device and the batch; on the console and as the start
        event."""
        cfg = self.cfg
        counts = count_parameters(unwrap(self.model))
        flops = flops_per_token(cfg.model)
        self.report.started(
            counts=counts,
            flops_per_token=flops,
            tokens=self.state.tokens,
            checkpoint=self.checkpointer.resumed(),
        )
        tokens_per_step = self.data.tokens_per_step
        self.report.log(
            f"data {data_dir} (vocab {manifest.vocab_size}, "
            f"{sum(shard.tokens for shard in manifest.train):,} train tokens); device {device}, "
            f"world size {env.world_size}, {tokens_per_step:,} tokens/step ({cfg.train.micro_batch_size} x "
            f"{cfg.model.seq_len} x {env.world_size} ranks x {self.data.accum} accum), "
            f"{flops / 1e6:.1f} MFLOPs/token"
        )
        self.report.event(
            "start",
            self.state.step,
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

            self.step()

            if state.step % self.cfg.train.log_every == 0:
                self.read_step_log()
            last = self.schedule.end.ends_at(state.step, state.tokens)
            self.evaluator.maybe_evaluate(state, last=last)  # the last step's eval comes before its save
            self.sampler.maybe_sample(state.step)
            self.checkpointer.maybe_save(state.step, self.snapshot)
            if self.budget.beat_due():
                self.beat("running")
        return self.finish(agreed.decision)

    def agree(self) -> Agreement:
        """Every rank's stop causes, the budget's decay proposal and the time for a save, agreed by all
        ranks (every train.stop_check_every steps; at the other steps only what all ranks see alike)."""
        state = self.state
        pace = self.report.step_seconds
        decaying = self.schedule.end.plan is not None
        decay = self.budget.decay_proposal(state.step, pace, decaying)
        return self.stopper.agree(
            state.step, state.tokens, state.elapsed_seconds, decay, self.checkpointer.time_due(), pace
        )

    def follow_plan(self, plan: DecayPlan | None) -> None:
        """An end plan the ranks just agreed (the budget's LR decay, or where max_hours ends), once: from
        now on the LR schedule and the planned end follow it, and every checkpoint stores it."""
        state = self.state
        if plan is not None and self.schedule.end.plan is None:
            self.report.log(self.schedule.follow(plan, state.step, state.tokens))

    def step(self) -> None:
        """One optimizer step at the schedule's LR and Muon momentum. The batches fit the micro-batch: under
        train.micro_batch_size=auto an out-of-memory error in the first steps retries it smaller
        (TrainBatches.fit), so the loop never sees one."""
        cfg = self.cfg
        state = self.state
        state.lr = self.schedule.lr(state.step, state.tokens)
        set_muon_momentum(self.optimizer, self.schedule.muon_momentum(state.step, state.tokens))
        skip_spikes = self.skip_if_spike if cfg.train.skip_spike_updates else None

        def one_step() -> None:  # the micro-batch layout (self.data.accum) as it stands at each try
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

        self.data.fit(one_step, state.step, undo=self.forget_step)
        state.step += 1
        at_step(state.step)  # a lost peer is reported with this step
        state.tokens += self.data.tokens_per_step
        self.report.step_done(state.step, self.data.tokens_per_step)

    def forget_step(self) -> None:
        """What a step that ran out of memory left: its gradients and its row in the step log."""
        self.optimizer.zero_grad(set_to_none=True)
        self.steplog.discard(self.state.step + 1)

    def read_step_log(self) -> StepVerdict:
        """Collective: the steps logged since the last read go, in order, through the divergence guard and
        the spike detector to the reporter. Returns what the guards found in the last one."""
        rows = self.steplog.read()
        if not rows:
            return StepVerdict()
        state = self.state
        train = self.cfg.train
        tokens_per_second, step_seconds = self.report.window()
        self.stopper.mfu_floor.update(self.report.mfu(tokens_per_second), time.monotonic())
        data_wait = self.data.take_wait_seconds() / len(rows)
        planned_in = self.schedule.end.seconds_left(
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
        return StepVerdict(bad, spike)

    def skip_if_spike(self) -> bool:
        """train.skip_spike_updates: read this step's loss now (a host sync every step, by choice)."""
        return self.read_step_log().skip

    def beat(self, status: str) -> None:
        """The heartbeat the budget watcher reads: running | saving | stopping | done | preempted | failed."""
        state = self.state
        checkpoints = self.checkpointer
        pace = self.report.step_seconds
        self.budget.beat(
            status, state.step, state.tokens, pace, checkpoints.committed_step, checkpoints.committed
        )

    # ------------------------------------------------------------ the save

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
        plan = self.schedule.end.plan
        state.budget_decay = plan.to_dict() if plan else None  # the agreed end plan, as JSON
        state.spent_usd = self.budget.spent_usd(state.spent_usd)
        evaluated_now = self.evaluator.last_step == state.step
        progress = {
            "tokens": state.tokens,
            "val_loss": state.last_val_loss if evaluated_now else None,
            "best_val_loss": state.best_val_loss,
            "spent_usd": state.spent_usd,
        }
        return state, progress

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
        self.report.stopped(state.step, decision)
        if decision.consumes_stop_file:
            self.stopper.consume_stop_file()
        if decision.event:  # posted here, or relayed by the watcher from the heartbeat
            self.budget.event(decision.event, decision.reason, self.report.warn)
        self.beat("done" if decision.exit_code == 0 else "preempted")
        for line in self.checkpointer.summary():
            self.report.log(line)
        return decision.exit_code


def train(cfg: Config, run: RunArgs) -> int:
    # Signals are recorded from the start: a SIGTERM during setup (model build, resume, the data build) is
    # taken at the first stop agreement, by every rank at the same step, instead of killing one rank.
    signals = SignalFlag()
    signals.install()
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    env = init_distributed("cuda" if cuda else "cpu", cfg.train.collective_timeout_minutes)
    run_dir = Path(run.out)
    stop_file = stop_file_of(run.stop_file, run_dir)
    trainer = None
    budget = None
    # closed in reverse order, however far the start got: the trainer's parts, the budget, the lease, the
    # signal handlers, the process group
    with contextlib.ExitStack() as closing:
        closing.callback(shutdown_distributed)
        closing.callback(signals.uninstall)
        try:
            lease = hold_run_dir(run_dir, cfg.checkpoint, signals, env.is_rank0)  # one writer per run dir
            closing.callback(release, lease)
            device = pick_device(cfg, env.local_rank)
            rundir.prepare(run_dir, run.resume, run.overwrite, env)
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
            closing.callback(budget.close)
            trainer = Trainer(
                cfg,
                budget,
                run=run,
                stop_file=stop_file,
                env=env,
                device=device,
                signals=signals,
                closing=closing,
            )
            return trainer.run()
        except BaseException as error:
            exit_if_peer_lost(error)  # a collective failed because a peer is gone: exit 144 (retried)
            # the watcher must not go on reading "running" from a dead trainer
            with contextlib.suppress(Exception):
                if trainer is not None:
                    trainer.beat("failed")
                elif budget is not None:  # the trainer's start failed
                    budget.beat("failed")
                elif env.is_rank0:
                    Heartbeat(run_dir).fail_if_written()
            raise


def run(args: argparse.Namespace) -> int:
    """`pretrain train`: resolve the config, then print it or train."""
    cfg = config_from_args(args)
    plan_run(cfg, args)  # the size check, the batch layout for --gpu-type (app/trainer/planning.py)
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
