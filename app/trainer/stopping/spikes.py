"""Loss spikes: a detector (loss above k x its moving average) and a drill that injects them on the data
side, so the loop knows nothing of it."""

from __future__ import annotations

import torch


class SpikeDetector:
    """Flags a step whose loss exceeds `factor` x the exponential moving average of earlier losses.
    Spiking losses are not folded into the average, so one spike does not hide the next."""

    def __init__(self, factor: float, beta: float = 0.9, warmup: int = 10) -> None:
        self.factor, self.beta, self.warmup = factor, beta, warmup
        self.avg = 0.0
        self.seen = 0
        self.count = 0

    def update(self, loss: float) -> bool:
        spike = self.seen >= self.warmup and (loss != loss or loss > self.factor * self.avg)  # NaN too
        if spike:
            self.count += 1
        else:
            self.avg = loss if self.seen == 0 else self.beta * self.avg + (1 - self.beta) * loss
            self.seen += 1
        return spike

    def state_dict(self) -> dict:
        return {"avg": self.avg, "seen": self.seen, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.avg, self.seen, self.count = float(state["avg"]), int(state["seen"]), int(state["count"])


def spike_rows(rows: torch.Tensor, step: int, vocab_size: int) -> torch.Tensor:
    """A micro-batch (B, T+1 token ids, as `rows`) of uniformly random tokens: for a trained model, rare
    tokens in random order carry a loss near log(vocab), far above its running loss. Seeded by step, so
    runs stay reproducible."""
    g = torch.Generator().manual_seed(10_007 * step + 1)
    return torch.randint(0, vocab_size, tuple(rows.shape), generator=g).to(rows.dtype)


class SpikeDrill:
    """A batch source (`rows_at`, `state`, as app/data/loader.py's Prefetcher reads) that replaces the
    batches of optimizer steps [start, start + steps) (0-based: the steps taken after `start` were done)
    with spike batches: the observability drill drill.spike_at_step / drill.spike_batches."""

    def __init__(self, source, start: int, steps: int, accum: int, vocab_size: int) -> None:
        self.source, self.start, self.steps, self.accum, self.vocab = source, start, steps, accum, vocab_size
        self.state = source.state

    def covers(self, step_index: int) -> bool:
        return self.start <= step_index < self.start + self.steps

    def rows_at(self, micro_step: int) -> torch.Tensor:
        rows = self.source.rows_at(micro_step)
        return spike_rows(rows, micro_step, self.vocab) if self.covers(micro_step // self.accum) else rows
