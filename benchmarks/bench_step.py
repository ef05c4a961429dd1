"""The training step before and after the padded read-out (CPU, eager, measured alternately in one process).

before: the head's logits over the true vocabulary, kept by the output for the caller, fp32 cross-entropy
        on them (the read-out as it was);
now:    embedding and head padded to a multiple of 128, pad logits cut off, only the loss returned
        (app/trainer/model/gpt.py; under train.compile the norm, head and loss are one compiled region).

On the tiny preset (vocabulary 2048, already a multiple of 128) the ratio shows the step is at least as
fast as before; at GPT-2's vocabulary (50257 -> 50304) it shows what padding costs or gains on this CPU.
The GPU gain (tensor-core tiles, the fused compiled loss) needs a GPU: `pretrain bench` there.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from app.config import load_config
from app.trainer.model.gpt import GPT
from app.trainer.optimization.optimizer import build_optimizer

STEPS = 8
WARMUP = 2
ROUNDS = 3


class PreviousReadout(GPT):
    """The read-out before the padded one: no padding (vocab_multiple=1), logits kept alive like the old output."""

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.kept_logits = logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def seconds_per_step(model_class: type[GPT], vocab: int, multiple: int) -> float:
    cfg = load_config("tiny")
    m = dataclasses.replace(cfg.model, vocab_size=vocab, vocab_multiple=multiple)
    torch.manual_seed(0)
    model = model_class(m)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (cfg.train.micro_batch_size, m.seq_len), generator=g)
    y = torch.randint(0, vocab, (cfg.train.micro_batch_size, m.seq_len), generator=g)
    start = 0.0
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            start = time.perf_counter()
        loss = model(x, y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.kept_logits = None
    return (time.perf_counter() - start) / STEPS


def run() -> list[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: OpenMP threads that lose their core spin at every barrier
    try:
        return _compare()
    finally:
        torch.set_num_threads(threads)


def _compare() -> list[str]:
    lines = []
    for vocab in (2048, 50257):
        before, now = [], []
        for _ in range(ROUNDS):  # alternate, so drift in machine load hits both alike
            before.append(seconds_per_step(PreviousReadout, vocab, 1))
            now.append(seconds_per_step(GPT, vocab, 128))
        b, n = statistics.median(before), statistics.median(now)
        padded = -(-vocab // 128) * 128
        lines.append(
            f"tiny shapes, vocab {vocab} ({'padded to ' + str(padded) if padded != vocab else 'a multiple of 128'}): "
            f"now {b / n:.3f}x the speed of before (median of {ROUNDS} alternating rounds: before "
            f"{b * 1e3:.0f} ms/step, now {n * 1e3:.0f} ms/step; one thread)"
        )
    return lines
