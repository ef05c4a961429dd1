"""The training loop. `train_step` is the algorithm (get a batch, forward, backward, clip, update); the
Trainer runs it until the ranks agree to stop, with evaluation, checkpoints, the budget and the log each
behind one call into app/trainer/.

Run as `pretrain train ...` or, under torchrun, `torchrun --nproc-per-node N -m app.train ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from app.budget import BudgetExhausted, PriceAboveMax
from app.config import Config
from app.data.loader import Prefetcher, TrainLoader, fit_vocab, resolve_data_dir
from app.data.manifest import Manifest
from app.errors import UserError
from app.trainer import checkpoint as ckpt
from app.trainer import distributed as peers
from app.trainer import layout, stopping
from app.trainer.args import DESCRIPTION, RunArgs, add_arguments, config_from_args, print_config
from app.trainer.budget_link import BudgetLink
from app.trainer.checkpoint_state import TrainerState, find_checkpoint, restore_weights, schedule_note
from app.trainer.checkpoint_writer import CheckpointWriter, SaveResult
from app.trainer.distributed import DistEnv, init_distributed, shutdown_distributed
from app.trainer.evaluate import sample_text, validation_loss
from app.trainer.heartbeat import Heartbeat
from app.trainer.lease import hold_run_dir, release
from app.trainer.metrics import device_peak, flops_per_token
from app.trainer.model import count_parameters
from app.trainer.optim import build_optimizer, set_lr, set_muon_momentum, step_unless
from app.trainer.parallelize import clip_grad_norm, forget_compiled_graphs, grad_sync, unwrap
from app.trainer.report import Reporter
from app.trainer.rundir import check_fresh_start, move_run_aside
from app.trainer.runtime import autocast_for, configure_device, grad_accum_steps, pick_device
from app.trainer.schedule import muon_momentum_at
from app.trainer.spikes import SpikeDetector, SpikeDrill
from app.trainer.steplog import StepLog
from app.trainer.stopping import BadSteps, EarlyStopping, PlannedEnd, SignalFlag, StopAgreement, StopDecision


def train_step(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Prefetcher,
    accum: int,
    autocast,
    grad_clip: float,
    step: int,
    lr: float,
    log: StepLog,
    skip_update: Callable[[], bool] | None = None,
) -> None:
    """Optimizer step number `step` (1-based) over `accum` micro-batches. Nothing here reads a number back
    from the device: the losses and the gradient norm go to `log`, and a step whose gradient is not
    finite is skipped on the device. `skip_update` (train.skip_spike_updates) decides on the host instead."""
    set_lr(optimizer, lr)
    losses = None
    for micro in range(accum):
        x, y = batches.next()
        with grad_sync(model, last_micro_batch=micro == accum - 1), autocast:
            out = model(x, y)
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


OOM_RETRY_STEPS = 10  # an out-of-memory error later than this is not the layout's: it is raised


class Trainer:
    def __init__(
        self, *, cfg: Config, args: RunArgs, env: DistEnv, device, budget: BudgetLink, signals: SignalFlag
    ) -> None:
        self.cfg, self.args, self.env, self.device, self.budget = cfg, args, env, device, budget
        self.run_dir = Path(args.out)
        self.state = TrainerState()
        self.heartbeat = Heartbeat(self.run_dir, enabled=env.is_rank0)
        self.steplog = StepLog(env)
        self.step_seconds = 0.0  # moving average over reads of the step log: the device's pace
        self.last_saved_step = self.committed_step = -1  # the last save asked for / committed
        self.last_save: SaveResult | None = None  # its timings go to the heartbeat
        self.last_save_time = time.monotonic()
        self.last_eval_step = -1
        self.signals = signals

    def setup(self) -> None:
        cfg, env, t = self.cfg, self.env, self.cfg.train
        configure_device(self.device)
        _, peak = device_peak(cfg.metrics.gpu_type, cfg.metrics.peak_tflops, self.device)
        if t.mfu_floor and not peak:
            raise UserError(
                f"train.mfu_floor needs the device's peak to measure MFU, and {self.device.type} "
                "has none: set --gpu-type or metrics.peak_tflops, or drop train.mfu_floor"
            )
        self.report = Reporter(cfg, env, self.run_dir, peak)  # first: a busy port fails before the data
        self.log, self.warn = self.report.log, self.report.warn
        self.data_dir = resolve_data_dir(cfg.data, self.log)
        self.manifest = Manifest.load(self.data_dir)
        fit_vocab(cfg.model, self.manifest, self.data_dir)
        info = find_checkpoint(self.run_dir, self.args.resume, cfg.checkpoint.verify, env, self.warn)
        self.auto_micro_batch = layout.for_run(cfg, env.world_size, self.device, info, self.run_dir, self.log)
        self.accum = grad_accum_steps(cfg, env.world_size)
        self.tokens_per_step = self.accum * t.micro_batch_size * cfg.model.seq_len * env.world_size

        from app.trainer.memory import checkpoint_bytes, plan_for_training
        from app.trainer.parallelize import build_parallel_model

        torch.manual_seed(t.seed)
        self.parallel = plan_for_training(cfg, env.world_size, self.device)  # resolves parallel=auto
        est = self.parallel.fsdp if self.parallel.mode == "fsdp" else self.parallel.ddp
        self.log(f"parallel: {self.parallel.mode} ({self.parallel.reason}); estimate {est.describe()}")
        self.model = build_parallel_model(cfg, env, self.device, self.parallel.mode, self.log)
        self.counts = count_parameters(unwrap(self.model))
        self.optimizer = build_optimizer(unwrap(self.model), cfg.optim, self.device)
        self.loader = self.new_loader()
        self.early = EarlyStopping(patience=t.early_stop_patience, min_delta=t.early_stop_min_delta)
        self.spikes = SpikeDetector(factor=t.spike_factor)
        self.bad_steps = BadSteps(max_bad=t.max_bad_steps)
        resumed_unix = self._resume(info)
        self.writer = CheckpointWriter(
            self.run_dir,
            env.rank,
            env.world_size,
            cfg.checkpoint,
            expect_bytes=checkpoint_bytes(cfg),
            warn=self.warn,
        )
        self.autocast = autocast_for(cfg, self.device)
        self.batches = self.new_batches()  # after resume: from its position
        self.stop_file = self.args.stop_file or self.run_dir / "stop.json"
        self.planned = PlannedEnd.of(cfg, self.tokens_per_step, self.state.budget_decay)
        self.stopper = StopAgreement(
            stop_file=self.stop_file if env.is_rank0 else None,  # only the master pod's
            planned=self.planned,
            early=self.early,
            signals=self.signals,
            bad_steps=self.bad_steps,
            mfu_floor=(t.mfu_floor, t.mfu_floor_minutes),
            every=t.stop_check_every,
            say=self.log,
            warn=self.warn,
        )
        flops = flops_per_token(cfg.model)
        self.report.started(
            counts=self.counts,
            flops_per_token=flops,
            tokens=self.state.tokens,
            checkpoint_step=self.last_saved_step,
            checkpoint_unix=resumed_unix,
        )
        self.log(
            f"data {self.data_dir} (vocab {self.manifest.vocab_size}, "
            f"{sum(s.tokens for s in self.manifest.train):,} train tokens); device {self.device}, "
            f"world size {env.world_size}, {self.tokens_per_step:,} tokens/step ({t.micro_batch_size} x "
            f"{cfg.model.seq_len} x {env.world_size} ranks x {self.accum} accum), {flops / 1e6:.1f} MFLOPs/token"
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

    def new_loader(self) -> TrainLoader:
        t, m, env = self.cfg.train, self.cfg.model, self.env
        return TrainLoader(
            data_dir=self.data_dir,
            seq_len=m.seq_len,
            micro_batch_size=t.micro_batch_size,
            rank=env.rank,
            world_size=env.world_size,
            seed=t.seed,
            vocab_size=m.vocab_size,
        )

    def new_batches(self) -> Prefetcher:
        """The loader's micro-batches on the device, through the spike drill when it is on."""
        t, source, self.drill = self.cfg.train, self.loader, None
        if t.inject_spike_at_step:
            source = self.drill = SpikeDrill(
                source, t.inject_spike_at_step, t.spike_batches, self.accum, self.cfg.model.vocab_size
            )
        return Prefetcher(source, self.device, t.prefetch)

    def retry_smaller(self, error: torch.OutOfMemoryError, step: int, first_micro: int) -> None:
        """train.micro_batch_size=auto: out of memory in this process's first steps halves the micro-batch
        (recorded in the run dir for the next start) and retries the step on the same samples in the same
        order; with several ranks, whose collectives cannot be unwound, the retry is the restart."""
        t, old = self.cfg.train, self.cfg.train.micro_batch_size
        early = self.auto_micro_batch and step < self.first_step + OOM_RETRY_STEPS
        smaller = layout.halve_after_oom(self.cfg, self.env, self.run_dir, self.warn, step) if early else 0
        if not smaller:
            raise error
        forget_compiled_graphs()  # the old size's graphs never run again
        self.optimizer.zero_grad(set_to_none=True)
        self.steplog.discard(step + 1)
        self.batches.close()
        t.micro_batch_size, self.accum = smaller, old * self.accum // smaller
        self.loader = self.new_loader()
        self.loader.state.micro_steps = first_micro * old // smaller  # the same samples next
        self.batches = self.new_batches()
        self.log(
            f"out of memory at micro-batch {old} (step {step + 1}): retrying it at micro-batch {smaller} "
            f"x accumulation {self.accum}, same data"
        )

    def _resume(self, info) -> float:
        """Restore the newest usable checkpoint (per --resume); returns its save time (0: none)."""
        if info is None:
            return 0.0
        restore_weights(unwrap(self.model), self.optimizer, info, self.env, self.warn, self.log)
        self.state = st = TrainerState(**ckpt.load_trainer_state(info))
        parts = [(self.loader, st.loader), (self.early, st.early_stopping), (self.spikes, st.spikes)]
        for part, saved in [*parts, (self.bad_steps, st.bad_steps)]:
            if saved:
                part.load_state_dict(saved)
        self.last_saved_step = self.committed_step = info.step if self.args.resume == "auto" else -1
        self.log(f"resumed from {ckpt.describe(info)}")
        if note := schedule_note(info, self.cfg, st.budget_decay):
            self.log(note)
        return float(info.meta.get("saved_unix", 0.0))

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        cfg, st = self.cfg, self.state
        skip_spikes = self.skip_if_spike if cfg.train.skip_spike_updates else None
        self.report.open_progress(cfg.train.max_steps, st.step)
        self.write_heartbeat("running")
        start, elapsed_before, self.first_step = time.monotonic(), st.elapsed_seconds, st.step
        while True:
            now = time.monotonic()
            st.elapsed_seconds = elapsed_before + (now - start)
            minutes = cfg.checkpoint.every_minutes
            save_due = bool(minutes) and now - self.last_save_time >= minutes * 60
            proposal = self.budget.decay_proposal(st.step, self.step_seconds, bool(st.budget_decay))
            decision, plan, save_now = self.stopper.agree(
                st.step, st.tokens, st.elapsed_seconds, proposal, save_due, self.step_seconds
            )
            if decision.stops:
                break
            if st.step == 0 and cfg.train.eval_every and self.last_eval_step != 0:
                self.evaluate()  # after the first agreement: a stop during setup skips it
                self.report.reset_window()
            if plan and not st.budget_decay:
                st.budget_decay = plan
                self.log(self.planned.follow(plan))
            if save_now and self.last_saved_step != st.step:
                self.save("every_minutes")
            st.lr = self.planned.lr(st.step, st.tokens, cfg.schedule, cfg.optim)
            set_muon_momentum(self.optimizer, muon_momentum_at(st.step, st.lr, cfg.schedule, cfg.optim))
            first_micro = self.loader.state.micro_steps
            try:
                train_step(
                    model=self.model,
                    optimizer=self.optimizer,
                    batches=self.batches,
                    accum=self.accum,
                    autocast=self.autocast,
                    grad_clip=cfg.optim.grad_clip,
                    step=st.step + 1,
                    lr=st.lr,
                    log=self.steplog,
                    skip_update=skip_spikes,
                )
            except torch.OutOfMemoryError as error:
                self.retry_smaller(error, st.step, first_micro)
                continue
            st.step += 1
            peers.at_step(st.step)  # named if a peer is lost
            st.tokens += self.tokens_per_step
            self.report.step_done(st.step, self.tokens_per_step)
            if st.step % cfg.train.log_every == 0:
                self.read_step_log()
            last = self.planned.check(st.step, st.tokens, 0.0) is not None  # evaluated before its save
            if cfg.train.eval_every and (st.step % cfg.train.eval_every == 0 or last):
                self.evaluate()
            if cfg.train.sample_every and st.step % cfg.train.sample_every == 0:
                text = sample_text(
                    self.model,
                    self.data_dir,
                    cfg.train.seed + st.step,
                    self.device,
                    fsdp=self.parallel.mode == "fsdp",
                )  # every rank: FSDP gathers
                self.log(f"sample at step {st.step}: {text!r}")
            if cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0:
                self.save("every_steps")
            self.report_save(self.writer.poll())
            if self.heartbeat.due():
                self.write_heartbeat("running")
        return self.finish(decision)

    def read_step_log(self) -> tuple[bool, bool]:
        """Collective: the steps logged since the last read go, in order, through the divergence guard and
        the spike detector to the reporter. Returns (bad, spike) of the last step."""
        rows = self.steplog.read()
        if not rows:
            return False, False
        st, t = self.state, self.cfg.train
        tps, seconds = self.report.window()
        self.stopper.mfu_floor.update(self.report.mfu(tps), time.monotonic())
        self.step_seconds = seconds if self.step_seconds == 0 else 0.5 * (self.step_seconds + seconds)
        data_wait, self.batches.wait_seconds = self.batches.wait_seconds / len(rows), 0.0
        planned_in = self.planned.seconds_left(st.step, st.tokens, st.elapsed_seconds, self.step_seconds, tps)
        bad = spike = False
        for r in rows:
            bad = self.bad_steps.update(r.finite)  # the device skipped this update exactly when not finite
            spike = not bad and self.spikes.update(r.loss)
            self.report.guards(r, bad, spike, self.bad_steps, self.spikes, t.skip_spike_updates)
            if r.step % t.log_every == 0 or spike or bad:
                injected = self.drill is not None and self.drill.covers(r.step - 1)
                tokens = st.tokens - (st.step - r.step) * self.tokens_per_step
                self.report.train(
                    r,
                    tokens=tokens,
                    tokens_per_second=tps,
                    step_seconds=seconds,
                    data_wait_seconds=data_wait,
                    spike=spike,
                    bad=bad,
                    injected=injected,
                    seconds_to_planned_end=planned_in,
                )
        return bad, spike

    def skip_if_spike(self) -> bool:
        """train.skip_spike_updates: read this step's loss now (a host sync every step, by choice)."""
        return any(self.read_step_log())

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
        st.last_val_loss, st.last_eval_step = val, st.step
        if math.isfinite(val) and (st.best_val_loss is None or val < st.best_val_loss):
            st.best_val_loss = val
        self.early.update(val)
        self.last_eval_step = st.step
        self.report.eval(st.step, val, bpb)

    def write_heartbeat(self, state: str) -> None:
        st, committed = self.state, self.committed_step
        self.heartbeat.write(state, st.step, st.tokens, self.step_seconds, committed, self.last_save)

    def save(self, reason: str, final: bool = False) -> None:
        """Collective; in the background unless `final` (a stop). Step 0 is never saved: nothing has been
        learned, and a restart from the seed is the same run (exact resume needs no checkpoint for it)."""
        st = self.state
        if st.step == 0:
            return
        self.read_step_log()  # the guards' state goes into the checkpoint
        st.loader, st.early_stopping = self.loader.state_dict(), self.early.state_dict()
        st.spikes, st.bad_steps = self.spikes.state_dict(), self.bad_steps.state_dict()
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
        self.report_save(self.writer.wait())  # the previous background save, if one is still running
        self.write_heartbeat("saving")
        files = [self.data_dir / "tokenizer.json"]  # a checkpoint dir alone is enough to sample or export
        result = self.writer.save(st.step, self.model, self.optimizer, asdict(st), meta, files, reason, final)
        self.last_saved_step, self.last_save_time = st.step, time.monotonic()
        self.report_save(result)
        self.write_heartbeat("running")

    def report_save(self, result: SaveResult | None) -> None:
        """Report a save once it is committed (at once when synchronous, later from the background)."""
        if result is not None:
            self.last_save, self.committed_step = result, result.step
            self.report.checkpoint(result)

    def finish(self, decision: StopDecision) -> int:
        st = self.state
        self.read_step_log()
        self.report.close_progress()
        self.log(f"stopping at step {st.step}: {decision.reason}")
        self.report.stop_state(decision.gauge_code)
        self.write_heartbeat("stopping")
        if decision.planned_or_early and self.last_eval_step != st.step and self.cfg.train.eval_every:
            self.evaluate()
        if decision.saves and self.last_saved_step != st.step:
            self.save(decision.name, final=True)
        if decision.saves:
            self.report_save(self.writer.wait())  # a stop ends on a complete, committed checkpoint
        else:
            self.writer.abandon()  # immediate: exit now; a pending write is cancelled, its temp dir removed
        self.report.event(
            "event",
            st.step,
            event="stop",
            cause=decision.name,
            reason=decision.reason,
            exit_code=decision.exit_code,
        )
        if self.env.is_rank0 and decision.consumes_stop_file:
            self.stopper.consume_stop_file()
        if self.env.is_rank0 and decision.event:  # posted here, or relayed by the watcher (heartbeat)
            posted = self.budget.event(decision.event, decision.reason, self.warn)
            self.heartbeat.event = {"reason": decision.event, "message": decision.reason, "posted": posted}
        self.write_heartbeat("done" if decision.exit_code == 0 else "preempted")
        if self.env.is_rank0:
            for line in ckpt.summary(self.run_dir, self.cfg.checkpoint.verify, self.warn):
                self.log(line)
        return decision.exit_code

    def close(self) -> None:
        if hasattr(self, "batches"):
            self.batches.close()
        if hasattr(self, "writer"):
            self.writer.abandon()  # still pending only after a crash: the last committed checkpoint stands
        if hasattr(self, "report"):
            self.report.close()


def train(cfg: Config, args: RunArgs) -> int:
    # Signals are recorded from the start: a SIGTERM during setup (model build, resume, the data build) is
    # taken at the first stop agreement, by every rank at the same step, instead of killing one rank.
    signals = SignalFlag()
    signals.install()
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    env = init_distributed("cuda" if cuda else "cpu", cfg.train.collective_timeout_minutes)
    trainer = budget = lease = None
    try:
        lease = hold_run_dir(Path(args.out), cfg.checkpoint, signals, env.is_rank0)  # one writer per run dir
        device = pick_device(cfg, env.local_rank)
        if check_fresh_start(args.out, args.resume, args.overwrite):
            if env.is_rank0:
                move_run_aside(args.out, print)
            env.barrier()
        if env.is_rank0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            ckpt.clean_temp_dirs(Path(args.out))
        env.barrier()
        stop_file = args.stop_file or Path(args.out) / "stop.json"
        try:
            budget = BudgetLink(cfg, Path(args.out), stop_file, env.is_rank0, env.world_size)
        except (BudgetExhausted, PriceAboveMax) as e:  # a deliberate end before any work: exit 0
            if env.is_rank0:
                spent = isinstance(e, BudgetExhausted)
                print(f"{'budget already spent, nothing to do' if spent else 'price guard'}: {e}", flush=True)
                Heartbeat(Path(args.out)).write("done")  # tells a sidecar watcher we are done
            return 0
        trainer = Trainer(cfg=cfg, args=args, env=env, device=device, budget=budget, signals=signals)
        trainer.setup()
        return trainer.run()
    except BaseException as error:
        peers.exit_if_peer_lost(error)  # a collective failed because a peer is gone: exit 144 (retried)
        # the watcher must not go on reading "running" from a dead trainer
        with contextlib.suppress(Exception):
            if trainer is not None:
                trainer.write_heartbeat("failed")
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
    stopping.check_stop_file(stop_file, out)
    return train(cfg, RunArgs(out, args.resume, stop_file, args.overwrite))


def main(argv: list[str] | None = None) -> int:
    from app.command import main_for

    return main_for("pretrain train", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
