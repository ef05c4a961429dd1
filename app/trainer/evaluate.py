"""Validation loss (nats/token, and bits per UTF-8 byte) and the periodic sample, run on every rank."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from app.config import Config
from app.data.loader import val_batches
from app.trainer.distributed import DistEnv, all_reduce_sum
from app.trainer.generate import generate
from app.trainer.parallelize import unwrap


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
    total = torch.zeros(2, dtype=torch.float64, device=device)
    m, t = cfg.model, cfg.train
    batches = val_batches(
        data_dir, m.seq_len, t.micro_batch_size, t.eval_batches, env.rank, env.world_size, m.vocab_size
    )
    # Eager even when the blocks are compiled: no-grad mode and a short last batch would each compile
    # (and keep) graphs of their own; an eval forward costs a fraction of the steps between evals.
    with torch.compiler.set_stance("force_eager"):
        for x, y in batches:
            with autocast:
                out = gpt(x.to(device), y.to(device))
            total[0] += out.loss.double() * x.size(0)
            total[1] += x.size(0)
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

    tok = load_tokenizer(data_dir)
    gpt = unwrap(model)
    gpt.eval()
    ids = torch.tensor([tok.encode("\n") or [tok.eot_id]], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.compiler.set_stance("force_eager"):
        out = generate(gpt, ids, tokens, generator=generator, use_cache=not fsdp)
    gpt.train()
    return tok.decode(out[0, ids.size(1) :].tolist())
