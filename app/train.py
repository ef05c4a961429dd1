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
from app.data.loader import TrainLoader, fit_vocab, resolve_data_dir, val_batches
from app.data.manifest import Manifest
from app.trainer import checkpoint as ckpt
from app.trainer.args import DESCRIPTION, add_arguments, config_from_args, print_config
from app.trainer.budget_link import BudgetLink
from app.trainer.heartbeat import Heartbeat
from app.trainer.metrics import detect_gpu_type, flops_per_token, peak_flops
from app.trainer.model import GPT, count_parameters
from app.trainer.optim import build_optimizer, fit_state, set_lr
from app.trainer.parallel import (
    DistEnv,
    all_reduce_mean,
    all_reduce_sum,
    init_distributed,
    load_state,
    model_state_dict,
    optimizer_state_dict,
    shutdown_distributed,
    unwrap,
)
from app.trainer.report import Reporter
from app.trainer.runtime import autocast_for, grad_accum_steps, pick_device
from app.trainer.schedule import DecayPlan, lr_at
from app.trainer.spikes import SpikeDetector, spike_batch
from app.trainer.stopping import (
    EarlyStopping,
    PlannedEnd,
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
    budget_decay: dict | None = None  # DecayPlan once the budget started the decay
    spent_usd: float | None = None


class Trainer:
    def __init__(
        self, cfg: Config, args: RunArgs, env: DistEnv, device: torch.device, budget: BudgetLink
    ) -> None:
        self.cfg, self.args, self.env, self.device, self.budget = cfg, args, env, device, budget
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

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg, env = self.cfg, self.env
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.clean_temp_dirs(self.run_dir)
        env.barrier()
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
        self.loader = TrainLoader(
            self.data_dir,
            cfg.model.seq_len,
            cfg.train.micro_batch_size,
            env.rank,
            env.world_size,
            cfg.train.seed,
        )
        self.early = EarlyStopping(cfg.train.early_stop_patience, cfg.train.early_stop_min_delta)
        self.spikes = SpikeDetector(cfg.train.spike_factor)
        self._maybe_resume(unwrap(model))
        self.model = torch.compile(model) if cfg.train.compile else model
        self.writer = ckpt.CheckpointWriter(self.run_dir, env.rank, env.world_size, env.barrier)
        self.autocast = autocast_for(cfg, self.device)

        gpu_type = cfg.metrics.gpu_type
        if not gpu_type and self.device.type == "cuda":
            gpu_type = detect_gpu_type(torch.cuda.get_device_name(self.device))
        self.peak = peak_flops(gpu_type, cfg.metrics.peak_tflops)
        self.flops_per_token = flops_per_token(cfg.model)

        self.stop_file = self.args.stop_file or self.run_dir / "stop.json"
        planned = PlannedEnd(cfg.train.max_steps, cfg.train.max_tokens, cfg.train.max_hours * 3600)
        self.stopper = StopAgreement(
            self.stop_file,
            planned,
            self.early,
            self.rank0,
            torch.device("cpu") if self.device.type == "cpu" else self.device,
        )
        self.report = Reporter(cfg, env, self.run_dir, with_mfu=bool(self.peak))
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
        spec = self.args.resume
        info = None
        if spec == "auto":
            info = ckpt.resolve_latest(self.run_dir, self.cfg.checkpoint.verify, warn=self.log)
        elif spec != "never":
            info = ckpt.resolve(spec, self.cfg.checkpoint.verify, warn=self.log)
        if info is None:
            return
        ckpt.check_compatible(model, ckpt.load_model_shapes(info), info.path)  # every rank, header only
        # Rank 0 reads the full tensors; load_state broadcasts and re-shards them for this mode and world size.
        reads = self.rank0 or not self.env.distributed
        model_state = ckpt.load_model_state(info) if reads else {}
        opt_state = None
        if info.has_optimizer:
            opt_state = ckpt.load_optimizer_state(info) if reads else {}
            if opt_state:  # another optimizer mode or grouping: convert (or refuse in one line)
                opt_state, notes = fit_state(opt_state, self.optimizer, model)
                for note in notes:
                    self.log(note)
        else:
            self.log(f"warning: {info.path} has no optimizer state; the optimizer restarts from zero moments")
        load_state(model, self.optimizer, model_state, opt_state)
        del model_state, opt_state
        saved_world = info.meta.get("world_size")
        if saved_world != self.env.world_size:
            self.log(
                f"resharding: checkpoint of world size {saved_world} on {self.env.world_size}: weights and "
                "optimizer restored exactly, data continues at the same global sample, RNG states start fresh"
            )
        self.state = TrainerState(**ckpt.load_trainer_state(info))
        self.loader.load_state_dict(self.state.loader)
        if self.state.early_stopping:
            self.early.load_state_dict(self.state.early_stopping)
        if self.state.spikes:
            self.spikes.load_state_dict(self.state.spikes)
        rng = ckpt.load_rng_state(info, self.env.rank)
        if rng is not None and saved_world == self.env.world_size:
            ckpt.set_rng_state(rng)
        self.last_saved_step = info.step if spec == "auto" else -1
        self.resumed_saved_unix = float(info.meta.get("saved_unix", 0.0))
        self.log(f"resumed from {ckpt.describe(info)}")

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
        spike = self.spikes.update(loss)
        if spike:
            self.log(
                f"loss spike at step {step}: {loss:.3f} vs moving average {self.spikes.avg:.3f}"
                + (" (update skipped)" if cfg.train.skip_spike_updates else "")
            )
        if not (spike and cfg.train.skip_spike_updates):
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
            "injected": bool(inject),
            "loop_losses": [float(v) / self.accum for v in loop_sums],
        }

    # ------------------------------------------------------------ eval, sample, save

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        cfg = self.cfg
        model = unwrap(self.model)
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for x, y in val_batches(
            self.data_dir,
            cfg.model.seq_len,
            cfg.train.micro_batch_size,
            cfg.train.eval_batches,
            self.env.rank,
            self.env.world_size,
        ):
            with self.autocast:
                out = model(x.to(self.device), y.to(self.device))
            total[0] += out.loss.double() * x.size(0)
            total[1] += x.size(0)
        all_reduce_sum(total, self.env)
        model.train()
        val = float(total[0] / total[1])
        bpb = val / math.log(2) / self.manifest.bytes_per_token("val")
        self.state.last_val_loss = val
        if self.state.best_val_loss is None or val < self.state.best_val_loss:
            self.state.best_val_loss = val
        self.early.update(val)
        self.last_eval_step = self.state.step
        self.report.eval(self.state.step, val, bpb)
        return val, bpb

    def sample_text(self, prompt: str = "\n", tokens: int = 64) -> str:
        """The same seed on every rank, so under FSDP all ranks draw the same tokens in lockstep."""
        from app.data.tokenizer import load_tokenizer

        tok = load_tokenizer(self.data_dir)
        model = unwrap(self.model)
        model.eval()
        ids = torch.tensor([tok.encode(prompt) or [tok.eot_id]], device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed + self.state.step)
        out = model.generate(ids, tokens, generator=g)
        model.train()
        return tok.decode(out[0, ids.size(1) :].tolist())

    def beat(self, state: str) -> None:
        st = self.state
        self.heartbeat.write(
            state, st.step, st.tokens, self.step_seconds_avg, self.checkpoint_seconds, self.last_saved_step
        )

    def save(self, reason: str) -> None:
        st = self.state
        st.loader = self.loader.state_dict()
        st.early_stopping = self.early.state_dict()
        st.spikes = self.spikes.state_dict()
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

    def _seconds_to_planned_end(self, tps: float) -> float:
        t, st = self.cfg.train, self.state
        left = [(t.max_steps - st.step) * self.step_seconds_avg]
        if t.max_tokens and tps > 0:
            left.append((t.max_tokens - st.tokens) / tps)
        if t.max_hours:
            left.append(t.max_hours * 3600 - st.elapsed_seconds)
        return max(0.0, min(left))

    def run(self) -> int:
        cfg, st = self.cfg, self.state
        self.stopper.signals.install()
        if st.step == 0 and cfg.train.eval_every:
            self.evaluate()
        self.report.open_progress(cfg.train.max_steps, st.step)
        self.beat("running")
        start = time.monotonic()
        elapsed_before = st.elapsed_seconds
        window_tokens, window_start = 0, time.perf_counter()
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
            if decay and not st.budget_decay:
                st.budget_decay = {"start_step": st.step, "steps": decay}
                self.log(f"budget: starting the LR decay now, {decay} steps before the cap")
            if save_now and self.last_saved_step != st.step:
                self.save("every_minutes")
            m = self.train_step()
            self.report.step_done(st.step, self.tokens_per_step)
            window_tokens += self.tokens_per_step
            if st.step % cfg.train.log_every == 0 or m["spike"]:
                t = time.perf_counter()
                tps = window_tokens / max(t - window_start, 1e-9)
                window_tokens, window_start = 0, t
                mfu = self.flops_per_token * tps / (self.peak * self.env.world_size) if self.peak else None
                self.report.train(
                    st.step, st.tokens, m, tps, mfu, time.time() + self._seconds_to_planned_end(tps)
                )
            if cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
                self.evaluate()
            if cfg.train.sample_every and st.step % cfg.train.sample_every == 0:
                text = self.sample_text()  # every rank: FSDP's forward gathers shards from all of them
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
            self.save(decision.cause.name.lower())
        self.report.event(
            "event",
            st.step,
            event="stop",
            cause=decision.cause.name.lower(),
            reason=decision.reason,
            exit_code=decision.exit_code,
        )
        if self.rank0 and decision.cause in (StopCause.BUDGET, StopCause.IMMEDIATE):
            consume_stop_file(self.stop_file)
        self.beat("done" if decision.exit_code == 0 else "preempted")
        if self.rank0:
            verify = self.cfg.checkpoint.verify
            self.log(
                f"latest checkpoint: {ckpt.describe(ckpt.resolve_latest(self.run_dir, verify, self.log))}"
            )
            self.log(f"best checkpoint:   {ckpt.describe(ckpt.resolve_best(self.run_dir, verify, self.log))}")
        return decision.exit_code

    def close(self) -> None:
        if hasattr(self, "stopper"):
            self.stopper.signals.uninstall()
        if self.report is not None:
            self.report.close()


def train(cfg: Config, args: RunArgs) -> int:
    env = init_distributed("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    trainer = None
    budget = None
    try:
        device = pick_device(cfg, env.local_rank)
        stop_file = args.stop_file or Path(args.out) / "stop.json"
        try:
            budget = BudgetLink(cfg, Path(args.out), stop_file, env.is_rank0, env.world_size)
        except BudgetExhausted as e:
            if env.is_rank0:
                print(f"budget already spent, nothing to do: {e}", flush=True)
                Path(args.out).mkdir(parents=True, exist_ok=True)
                Heartbeat(Path(args.out)).write("done")  # tells a sidecar watcher we are done
            return 0
        trainer = Trainer(cfg, args, env, device, budget)
        trainer.setup()
        return trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        if budget is not None:
            budget.close()
        shutdown_distributed()


def run(args: argparse.Namespace) -> int:
    """`pretrain train`: resolve the config, then print it or train."""
    cfg = config_from_args(args)
    if args.print_config:
        return print_config(cfg)
    stop_file = Path(args.stop_file) if args.stop_file else None
    return train(cfg, RunArgs(Path(args.out), args.resume, stop_file))


def main(argv: list[str] | None = None) -> int:
    from app.command import main_for

    return main_for("pretrain train", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
