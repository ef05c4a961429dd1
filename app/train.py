"""The training loop: set up, step, evaluate, checkpoint, stop. Policy lives in the components
(config, schedule, stopping, checkpoint, budget, metrics); this file only wires them.

Run as `pretrain train ...` or, under torchrun, `torchrun --nproc-per-node N -m app.train ...`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app import checkpoint as ckpt
from app.budget.files import atomic_write_json
from app.config import Config
from app.data.loader import TrainLoader, val_batches
from app.data.prepare import Manifest
from app.errors import ConfigError, UserError
from app.metrics import JsonlLog, TrainerMetrics, detect_gpu_type, flops_per_token, peak_flops
from app.model import GPT, count_parameters
from app.optim import build_optimizer, set_lr
from app.parallel import (
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
from app.schedule import DecayPlan, budget_decay_steps, lr_at
from app.spikes import SpikeDetector, spike_batch
from app.stopping import (
    EarlyStopping,
    PlannedEnd,
    StopAgreement,
    StopCause,
    StopDecision,
    consume_stop_file,
)

STATUS_EVERY_SECONDS = 5.0


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


def pick_device(cfg: Config, env_local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        torch.cuda.set_device(env_local_rank)
        return torch.device("cuda", env_local_rank)
    return torch.device("cpu")


def resolve_data_dir(cfg: Config, log) -> Path:
    if cfg.data.dataset == "embedded":
        from app.data.corpus import embedded_dataset

        return embedded_dataset(
            cfg.data.tokenizer, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.cache_dir, log=log
        )
    path = Path(cfg.data.dataset)
    if not path.is_dir():
        raise UserError(f"data.dataset={path} is not a directory; run `pretrain prepare --out {path}` first")
    return path


def fit_vocab(cfg: Config, manifest: Manifest, data_dir: Path) -> None:
    """The model's vocab comes from the data unless set; shards with bigger ids are refused."""
    vocab = manifest.vocab_size
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = vocab
    elif vocab > cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer of {data_dir} has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size >= {vocab} or prepare the data with a matching tokenizer"
        )


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    per_micro = cfg.train.micro_batch_size * cfg.model.seq_len * world_size
    if not cfg.train.batch_tokens:
        return 1
    if cfg.train.batch_tokens % per_micro:
        raise ConfigError(
            f"train.batch_tokens={cfg.train.batch_tokens} is not a multiple of micro_batch_size x seq_len x "
            f"world_size = {per_micro}; use a multiple such as {max(1, round(cfg.train.batch_tokens / per_micro)) * per_micro}"
        )
    return cfg.train.batch_tokens // per_micro


class Trainer:
    def __init__(self, cfg: Config, args: RunArgs, env: DistEnv, device: torch.device) -> None:
        self.cfg, self.args, self.env, self.device = cfg, args, env, device
        self.run_dir = Path(args.out)
        self.rank0 = env.is_rank0
        self.state = TrainerState()
        self.metrics: TrainerMetrics | None = None
        self.jsonl: JsonlLog | None = None
        self.progress = None
        self.last_saved_step = -1
        self.last_status = 0.0
        self.last_budget_read = 0.0
        self.step_seconds_avg = 0.0
        self.checkpoint_seconds = 0.0
        self.last_ckpt_time = time.monotonic()
        self.last_eval_step = -1
        self.resumed_saved_unix = 0.0

    # ------------------------------------------------------------ setup

    def log(self, msg: str) -> None:
        if self.rank0:
            if self.progress is not None:
                self.progress.write(msg)
            else:
                print(msg, flush=True)

    def setup(self) -> None:
        cfg, env = self.cfg, self.env
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.clean_temp_dirs(self.run_dir)
        env.barrier()
        self.data_dir = resolve_data_dir(cfg, self.log)
        self.manifest = Manifest.load(self.data_dir)
        fit_vocab(cfg, self.manifest, self.data_dir)
        self.accum = grad_accum_steps(cfg, env.world_size)
        self.tokens_per_step = self.accum * cfg.train.micro_batch_size * cfg.model.seq_len * env.world_size

        from app.memory import plan as plan_parallel
        from app.parallel import build_parallel_model

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
        self.model = model
        if cfg.train.compile:
            self.model = torch.compile(self.model)
        self.writer = ckpt.CheckpointWriter(self.run_dir, env.rank, env.world_size, env.barrier)

        self.autocast = contextlib.nullcontext()
        if self.device.type == "cuda" and cfg.train.dtype in ("auto", "bf16"):
            self.autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        elif cfg.train.dtype == "bf16":
            self.autocast = torch.autocast("cpu", dtype=torch.bfloat16)

        gpu_type = cfg.metrics.gpu_type
        if not gpu_type and self.device.type == "cuda":
            gpu_type = detect_gpu_type(torch.cuda.get_device_name(self.device))
        self.peak = peak_flops(gpu_type, cfg.metrics.peak_tflops)
        self.flops_per_token = flops_per_token(cfg.model)

        stop_file = self.args.stop_file or self.run_dir / "stop.json"
        planned = PlannedEnd(cfg.train.max_steps, cfg.train.max_tokens, cfg.train.max_hours * 3600)
        self.stopper = StopAgreement(
            stop_file,
            planned,
            self.early,
            self.rank0,
            torch.device("cpu") if self.device.type == "cpu" else self.device,
        )
        self.stop_file = stop_file

        if cfg.metrics.port and env.is_local_rank0:
            self.metrics = TrainerMetrics(
                cfg.metrics.port,
                env.node,
                serve_global=self.rank0,
                with_mfu=bool(self.peak),
                addr=cfg.metrics.addr,
            )
            if self.rank0:
                self.metrics.tokens.inc(self.state.tokens)  # a counter of the run, across restarts
                if self.last_saved_step >= 0:
                    self.metrics.ckpt_step.set(self.last_saved_step)
                    self.metrics.ckpt_time.set(self.resumed_saved_unix)
                self.metrics.info.info(
                    {
                        "preset": cfg.preset,
                        "run": self.run_dir.name,
                        "world_size": str(env.world_size),
                        "parameters": str(self.counts.total),
                        "non_embedding_parameters": str(self.counts.non_embedding),
                    }
                )
        if self.rank0:
            self.jsonl = JsonlLog(self.run_dir / "metrics.jsonl")
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
        st = ckpt.load_trainer_state(info)
        self.state = TrainerState(**st)
        self.loader.load_state_dict(self.state.loader)
        if self.state.early_stopping:
            self.early.load_state_dict(self.state.early_stopping)
        if self.state.spikes:
            self.spikes.load_state_dict(self.state.spikes)
        rng = ckpt.load_rng_state(info, self.env.rank)
        if rng is not None and info.meta.get("world_size") == self.env.world_size:
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
        if self.jsonl:
            self.jsonl.write(
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
        loop_losses = [float(v) / self.accum for v in loop_sums]
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_seconds": dt,
            "data_wait_seconds": data_wait,
            "spike": spike,
            "injected": bool(inject),
            "loop_losses": loop_losses,
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

    def save(self, reason: str) -> None:
        st = self.state
        st.loader = self.loader.state_dict()
        st.early_stopping = self.early.state_dict()
        st.spikes = self.spikes.state_dict()
        st.spent_usd = self._spent_usd()
        meta = {
            "config": self.cfg.to_dict(),
            "tokens": st.tokens,
            "val_loss": st.last_val_loss if self.last_eval_step == st.step else None,
            "best_val_loss": st.best_val_loss,
            "spent_usd": st.spent_usd,
            "reason": reason,
            "data": {"dir": str(self.data_dir), "tokenizer_sha256": self.manifest.tokenizer.get("sha256")},
        }
        self._write_status("saving")
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
            self.log(
                f"checkpoint step {st.step} -> {result.path} ({result.bytes / 1e6:.1f} MB in "
                f"{result.seconds:.2f}s, {reason})"
            )
            self.jsonl.write(
                "checkpoint",
                st.step,
                path=str(result.path),
                seconds=result.seconds,
                bytes=result.bytes,
                reason=reason,
            )
            if self.metrics:
                m = self.metrics
                m.ckpt_seconds.set(result.seconds)
                m.ckpt_step.set(st.step)
                m.ckpt_time.set(time.time())
        self._write_status("running")

    # ------------------------------------------------------------ budget + status

    def _spent_usd(self) -> float | None:
        state = self._budget_state()
        return state.get("spent_usd") if state else self.state.spent_usd

    def _budget_state(self) -> dict | None:
        from app.budget import read_budget_state

        return read_budget_state(self.run_dir)

    def _decay_proposal(self, now: float) -> int:
        """Rank 0 proposes the budget-driven WSD decay from the watcher's projection."""
        cfg = self.cfg
        if not (
            self.rank0 and cfg.budget.cap_usd and cfg.schedule.name == "wsd" and not self.state.budget_decay
        ):
            return 0
        if now - self.last_budget_read < STATUS_EVERY_SECONDS:
            return 0
        self.last_budget_read = now
        state = self._budget_state()
        if not state or state.get("seconds_to_stop") is None:
            return 0
        # seconds_to_stop: when the watcher's graceful stop fires (checkpoint and margin already reserved)
        return budget_decay_steps(
            self.state.step,
            float(state["seconds_to_stop"]),
            self.step_seconds_avg,
            0.0,
            cfg.budget.decay_fraction,
        )

    def _write_status(self, state: str) -> None:
        if not self.rank0:
            return
        self.last_status = time.monotonic()
        atomic_write_json(
            self.run_dir / "status.json",
            {
                "step": self.state.step,
                "tokens": self.state.tokens,
                "step_seconds": self.step_seconds_avg,
                "checkpoint_seconds": self.checkpoint_seconds,
                "last_checkpoint_step": max(self.last_saved_step, 0),
                "state": state,
                "pid": os.getpid(),
                "updated_unix": time.time(),
            },
            durable=False,  # a heartbeat: rename keeps it whole, losing one on a crash is fine
        )

    # ------------------------------------------------------------ the loop

    def _record(self, m: dict, tps: float) -> None:
        st = self.state
        mfu = self.flops_per_token * tps / (self.peak * self.env.world_size) if self.peak else None
        if self.jsonl:
            row = {
                "loss": m["loss"],
                "lr": m["lr"],
                "grad_norm": m["grad_norm"],
                "tokens": st.tokens,
                "tokens_per_second": tps,
                "step_seconds": m["step_seconds"],
                "data_wait_seconds": m["data_wait_seconds"],
            }
            if mfu is not None:
                row["mfu"] = mfu
            if m["loop_losses"]:
                row["loop_losses"] = m["loop_losses"]
                row["refinement"] = (m["loop_losses"][0] - m["loop_losses"][-1]) / m["loop_losses"][0]
            if m["spike"]:
                row["spike"] = True
            if m["injected"]:
                row["injected_spike"] = True
            self.jsonl.write("train", st.step, **row)
        if self.metrics:
            self.metrics.node_tps.set(tps * self.env.local_world_size / self.env.world_size)
            if self.rank0:
                g = self.metrics
                g.train_loss.set(m["loss"])
                g.lr.set(m["lr"])
                g.grad_norm.set(m["grad_norm"])
                g.tps.set(tps)
                if mfu is not None:
                    g.mfu.set(mfu)
                g.step_seconds.set(m["step_seconds"])
                g.data_wait.set(m["data_wait_seconds"])
                g.planned_end.set(time.time() + self._seconds_to_planned_end(tps))
                g.spike.set(1 if m["spike"] else 0)
                if m["spike"]:
                    g.spikes.inc()
                for i, v in enumerate(m["loop_losses"]):
                    g.loop_loss.labels(loop=str(i)).set(v)
                if m["loop_losses"]:
                    g.refinement.set((m["loop_losses"][0] - m["loop_losses"][-1]) / m["loop_losses"][0])
                if self.device.type == "cuda":
                    g.gpu_mem.set(torch.cuda.max_memory_allocated(self.device))
        if self.progress is not None:
            post = {"loss": f"{m['loss']:.3f}", "tok/s": f"{tps:,.0f}"}
            if mfu is not None:
                post["mfu"] = f"{mfu:.1%}"
            self.progress.set_postfix(post, refresh=False)

    def _seconds_to_planned_end(self, tps: float) -> float:
        t, st = self.cfg.train, self.state
        left = [(t.max_steps - st.step) * self.step_seconds_avg]
        if t.max_tokens and tps > 0:
            left.append((t.max_tokens - st.tokens) / tps)
        if t.max_hours:
            left.append(t.max_hours * 3600 - st.elapsed_seconds)
        return max(0.0, min(left))

    def _step_metrics(self) -> None:
        """Every step, cheap: what the stalled-training alert and the token counter need."""
        g = self.metrics
        g.step.set(self.state.step)
        g.tokens.inc(self.tokens_per_step)
        g.last_step_time.set(time.time())

    def run(self) -> int:
        cfg, st = self.cfg, self.state
        self.stopper.signals.install()
        if st.step == 0 and cfg.train.eval_every:
            self._eval_and_log()
        use_bar = self.rank0 and cfg.metrics.progress and sys.stderr.isatty()
        if use_bar:
            from tqdm import tqdm

            self.progress = tqdm(total=cfg.train.max_steps, initial=st.step, unit="step", dynamic_ncols=True)
        self._write_status("running")
        start = time.monotonic()
        elapsed_before = st.elapsed_seconds
        window_tokens, window_start = 0, time.perf_counter()
        tps = 0.0
        while True:
            now = time.monotonic()
            st.elapsed_seconds = elapsed_before + (now - start)
            due = (
                bool(cfg.checkpoint.every_minutes)
                and now - self.last_ckpt_time >= cfg.checkpoint.every_minutes * 60
            )
            decision, decay, save_now = self.stopper.agree(
                st.step, st.tokens, st.elapsed_seconds, self._decay_proposal(now), due
            )
            if decision.cause != StopCause.NONE:
                break
            if decay and not st.budget_decay:
                st.budget_decay = {"start_step": st.step, "steps": decay}
                self.log(f"budget: starting the LR decay now, {decay} steps before the cap")
            if save_now and self.last_saved_step != st.step:
                self.save("every_minutes")
            m = self.train_step()
            if self.metrics and self.rank0:
                self._step_metrics()
            window_tokens += self.tokens_per_step
            if self.progress is not None:
                self.progress.update(1)
            if st.step % cfg.train.log_every == 0 or m["spike"]:
                t = time.perf_counter()
                tps = window_tokens / max(t - window_start, 1e-9)
                window_tokens, window_start = 0, t
                self._record(m, tps)
                if self.progress is None:
                    self.log(
                        f"step {st.step}/{cfg.train.max_steps} loss {m['loss']:.4f} lr {m['lr']:.2e} "
                        f"{tps:,.0f} tok/s"
                    )
            if cfg.train.eval_every and st.step % cfg.train.eval_every == 0:
                self._eval_and_log()
            if cfg.train.sample_every and st.step % cfg.train.sample_every == 0:
                text = self.sample_text()  # every rank: FSDP's forward gathers shards from all of them
                self.log(f"sample at step {st.step}: {text!r}")
            if cfg.checkpoint.every_steps and st.step % cfg.checkpoint.every_steps == 0:
                self.save("every_steps")
            if self.rank0 and time.monotonic() - self.last_status >= STATUS_EVERY_SECONDS:
                self._write_status("running")
        return self._finish(decision)

    def _eval_and_log(self) -> None:
        val, bpb = self.evaluate()
        self.last_eval_step = self.state.step
        self.log(f"step {self.state.step}: val loss {val:.4f}, {bpb:.3f} bits/byte")
        if self.jsonl:
            self.jsonl.write("eval", self.state.step, val_loss=val, val_bpb=bpb)
        if self.metrics and self.rank0:
            self.metrics.val_loss.set(val)
            self.metrics.val_bpb.set(bpb)

    def _finish(self, decision: StopDecision) -> int:
        st = self.state
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.log(f"stopping at step {st.step}: {decision.reason}")
        if self.metrics and self.rank0:
            self.metrics.stop_state.set(int(decision.cause))
        self._write_status("stopping")
        if (
            decision.cause in (StopCause.PLANNED, StopCause.EARLY)
            and self.last_eval_step != st.step
            and self.cfg.train.eval_every
        ):
            self._eval_and_log()
        if decision.saves and self.last_saved_step != st.step:
            self.save(decision.cause.name.lower())
        if self.jsonl:
            self.jsonl.write(
                "event",
                st.step,
                event="stop",
                cause=decision.cause.name.lower(),
                reason=decision.reason,
                exit_code=decision.exit_code,
            )
        if self.rank0 and decision.cause in (StopCause.BUDGET, StopCause.IMMEDIATE):
            consume_stop_file(self.stop_file)
        self._write_status("done" if decision.exit_code == 0 else "preempted")
        if self.rank0:
            verify = self.cfg.checkpoint.verify
            self.log(
                f"latest checkpoint: {ckpt.describe(ckpt.resolve_latest(self.run_dir, verify, self.log))}"
            )
            self.log(f"best checkpoint:   {ckpt.describe(ckpt.resolve_best(self.run_dir, verify, self.log))}")
        return decision.exit_code

    def close(self) -> None:
        self.stopper.signals.uninstall() if hasattr(self, "stopper") else None
        if self.metrics:
            self.metrics.close()
        if self.jsonl:
            self.jsonl.close()


def start_budget(cfg: Config, args: RunArgs, env: DistEnv):
    """Raise BudgetExhausted when the ledger says the cap is spent (every rank reads it, so all agree);
    else rank 0 hosts the watcher thread unless a sidecar watches. Returns the watcher handle or None."""
    if not cfg.budget.cap_usd:
        return None
    from app.budget import check_not_exhausted, start_in_process

    run_dir = Path(args.out)
    check_not_exhausted(cfg.budget, run_dir)
    if env.is_rank0 and cfg.budget.in_process:
        return start_in_process(cfg.budget, run_dir, args.stop_file or run_dir / "stop.json", env.world_size)
    return None


def train(cfg: Config, args: RunArgs) -> int:
    env = init_distributed("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    trainer = None
    budget = None
    try:
        device = pick_device(cfg, env.local_rank)
        if cfg.budget.cap_usd:
            from app.budget import BudgetExhausted

            try:
                budget = start_budget(cfg, args, env)
            except BudgetExhausted as e:
                if env.is_rank0:
                    print(f"budget already spent, nothing to do: {e}", flush=True)
                    Path(args.out).mkdir(parents=True, exist_ok=True)  # tell a sidecar watcher we are done
                    atomic_write_json(
                        Path(args.out) / "status.json",
                        {
                            "step": 0,
                            "tokens": 0,
                            "step_seconds": 0.0,
                            "checkpoint_seconds": 0.0,
                            "last_checkpoint_step": 0,
                            "state": "done",
                            "pid": os.getpid(),
                            "updated_unix": time.time(),
                        },
                        durable=False,
                    )
                return 0
        trainer = Trainer(cfg, args, env, device)
        trainer.setup()
        return trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        if budget is not None:
            budget.close()
        shutdown_distributed()


def main(argv: list[str] | None = None) -> int:
    from app.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
