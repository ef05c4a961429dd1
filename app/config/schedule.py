"""The learning-rate schedule's section (`schedule:`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScheduleConfig:
    """The learning-rate schedule (app/trainer/optimization/schedule.py)."""

    name: str = "cosine"  # LR schedule: cosine | wsd (warmup, stable, decay) | constant
    warmup_steps: int = 100  # linear warm-up from 0 to the peak LR over this many steps
    decay_fraction: float = 0.2  # wsd: last fraction of max_steps spent decaying to min_lr
