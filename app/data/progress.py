"""Progress of `pretrain prepare`: a tqdm bar on a terminal, else a log line every N seconds; the summary."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.data.manifest import Manifest

Log = Callable[[str], None]


class Progress:
    """A tqdm bar on a terminal (bytes of input, docs/s, tokens/s, ETA), else a log line every N seconds."""

    def __init__(self, mode: str, total: int, initial: int, log: Log, every: float) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.total, self.initial, self.log, self.every = mode, max(total, 1), initial, log, every
        self.t0 = self.last = time.time()
        self.docs = self.tokens = 0
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="prepare",
                dynamic_ncols=True,
                smoothing=0.05,
            )

    def update(self, done: int, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        now = time.time()
        rate = f"{self.docs / max(now - self.t0, 1e-9):,.0f} docs/s, {si(self.tokens / max(now - self.t0, 1e-9))} tok/s"
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(rate, refresh=False)
        elif self.mode == "log" and now - self.last >= self.every:
            self.last = now
            frac = (done - self.initial) / max(self.total - self.initial, 1)
            eta = (now - self.t0) * (1 - frac) / frac if frac > 0 else float("nan")
            self.log(
                f"prepare: {100 * done / self.total:.1f}% of {self.total / 1e9:.2f} GB input, "
                f"{self.docs:,} docs, {si(self.tokens)} tokens ({rate}), ETA {duration(eta)}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def summary(m: Manifest, out: Path, seconds: float, new_tokens: int, log: Log) -> None:
    train, val = m.tokens("train"), m.tokens("val")
    total_bytes = sum(s.bytes for s in m.train + m.val)
    log(
        f"{m.documents:,} documents, {train:,} train tokens in {len(m.train)} shards + {val:,} val tokens in "
        f"{len(m.val)} shards ({m.dtype}, vocab {m.vocab_size}), {total_bytes / max(train + val, 1):.2f} bytes/token"
    )
    rate = f", {si(new_tokens / max(seconds, 1e-9))} tokens/s" if new_tokens else ""
    log(f"done in {duration(seconds)}{rate} -> {out}")
