"""Faults a run injects on purpose (`drill:`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DrillConfig:
    """Faults a run injects on purpose, to rehearse what it does about them; all off (0) in real runs."""

    # micro-batches above this many sequences fail as out of memory (a CPU rehearses
    # train.micro_batch_size=auto's halving); 0 = off
    oom_above: int = 0
    # with drill.oom_above, fail on this one rank (its RANK), as a real GPU does, leaving the others waiting
    # in a collective; "" = every rank
    oom_rank: str = ""
    # feed high-loss batches from this optimizer step on (rehearses the loss-spike alert); 0 = off
    spike_at_step: int = 0
    spike_batches: int = 3  # how many steps drill.spike_at_step feeds
    # saves of later steps fail as on a full checkpoint volume (rehearses exit 6 and its resume); 0 = off
    volume_full_after_step: int = 0
