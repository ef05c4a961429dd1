"""Evaluation during training, on every rank: the validation loss (nats/token, and bits per UTF-8 byte)
every train.eval_every steps (`Evaluator`), and a short sample every train.sample_every steps (`Sampler`).
Each decides itself when it is due."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from app.config import Config
from app.data.loader import val_batches
from app.trainer.model.generate import generate
from app.trainer.parallel.distributed import DistEnv, all_reduce_sum
from app.trainer.parallel.parallelize import unwrap
from app.trainer.stopping.agreement import EarlyStopping


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    data_dir: Path,
    cfg: Config,
    env: DistEnv,
    device: torch.device,
    autocast,
    bytes_per_token: float,
) -> tuple[float, float]:
    """(mean loss over the fixed validation windows of every rank, bits per byte). Collective."""
    gpt = unwrap(model)
    gpt.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, sequences
    batches = val_batches(
        data_dir,
        cfg.model.seq_len,
        cfg.train.micro_batch_size,
        cfg.train.eval_batches,
        env.rank,
        env.world_size,
        cfg.model.vocab_size,
    )
    # Eager even when the blocks are compiled: no-grad mode and a short last batch would each compile
    # (and keep) graphs of their own; an eval forward costs a fraction of the steps between evals.
    with torch.compiler.set_stance("force_eager"):
        for inputs, targets in batches:
            with autocast:
                out = gpt(inputs.to(device), targets.to(device))
            total[0] += out.loss.double() * inputs.size(0)
            total[1] += inputs.size(0)
    all_reduce_sum(total, env)
    gpt.train()
    val = float(total[0] / total[1])
    return val, val / math.log(2) / bytes_per_token


@torch.no_grad()
def sample_text(
    model: torch.nn.Module, data_dir: Path, seed: int, device: torch.device, fsdp: bool, tokens: int = 64
) -> str:
    """The same seed on every rank, so under FSDP all ranks draw the same tokens in lockstep. FSDP
    gathers shards in forward's hooks, which the cached decode path bypasses: no KV cache there. Eager
    even when the blocks are compiled: each new length would compile a new graph."""
    from app.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(data_dir)
    gpt = unwrap(model)
    gpt.eval()
    ids = torch.tensor([tokenizer.encode("\n") or [tokenizer.eot_id]], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.compiler.set_stance("force_eager"):
        out = generate(gpt, ids, tokens, generator=generator, use_cache=not fsdp)
    gpt.train()
    return tokenizer.decode(out[0, ids.size(1) :].tolist())


class Evaluator:
    """The validation loss every train.eval_every steps, of the untrained model at step 0, and at the
    planned or early end (before its save, so the last checkpoint carries it). Collective."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: Config,
        env: DistEnv,
        device: torch.device,
        autocast,
        *,
        data_dir: Path,
        bytes_per_token: float,
        early: EarlyStopping,
        report,
    ) -> None:
        """`early`: fed every val loss. `report`: the Reporter (app/trainer/reporting/report.py)."""
        self.model = model
        self.cfg = cfg
        self.env = env
        self.device = device
        self.autocast = autocast
        self.data_dir = data_dir
        self.bytes_per_token = bytes_per_token
        self.early = early
        self.report = report
        self.every = cfg.train.eval_every  # 0: off
        self.last_step = -1  # the step of the last evaluation

    def due(self, step: int, last: bool = False) -> bool:
        """Every train.eval_every steps, and at the `last` step; never twice at one step."""
        if not self.every or step == self.last_step:
            return False
        return step % self.every == 0 or last

    def maybe_evaluate(self, state, last: bool = False) -> None:
        """Evaluate at `state.step` when due; records the val loss and the best one in `state` (the
        TrainerState)."""
        if not self.due(state.step, last):
            return
        val, bits_per_byte = validation_loss(
            self.model, self.data_dir, self.cfg, self.env, self.device, self.autocast, self.bytes_per_token
        )
        state.last_val_loss = val
        state.last_eval_step = state.step
        if math.isfinite(val) and (state.best_val_loss is None or val < state.best_val_loss):
            state.best_val_loss = val
        self.early.update(val)
        self.last_step = state.step
        self.report.eval(state.step, val, bits_per_byte)


class Sampler:
    """A short sample every train.sample_every steps, logged. Every rank draws it (FSDP gathers)."""

    def __init__(
        self,
        model: torch.nn.Module,
        data_dir: Path,
        device: torch.device,
        *,
        seed: int,
        every: int,
        fsdp: bool,
        log: Callable[[str], None],
    ) -> None:
        self.model = model
        self.data_dir = data_dir
        self.device = device
        self.seed = seed
        self.every = every  # 0: off
        self.fsdp = fsdp
        self.log = log

    def maybe_sample(self, step: int) -> None:
        if not self.every or step % self.every:
            return
        text = sample_text(self.model, self.data_dir, self.seed + step, self.device, fsdp=self.fsdp)
        self.log(f"sample at step {step}: {text!r}")
