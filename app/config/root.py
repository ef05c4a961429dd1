"""The whole config: the preset a run started from and one section per concern (each section's dataclass
lives in the module of its name)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from app.config.budget import BudgetConfig
from app.config.checkpoint import CheckpointConfig
from app.config.data import DataConfig
from app.config.drill import DrillConfig
from app.config.metrics import MetricsConfig
from app.config.model import ModelConfig
from app.config.optim import OptimConfig
from app.config.plan import PlanConfig
from app.config.schedule import ScheduleConfig
from app.config.train import TrainConfig

DEFAULT_PRESET = "tiny"


@dataclass
class Config:
    """A run's whole config: the preset it started from and one section per concern."""

    # the preset the config started from (app/presets/): chosen with --preset or a config file's `preset:`,
    # not --set (its values are applied before --set)
    preset: str = DEFAULT_PRESET
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    drill: DrillConfig = field(default_factory=DrillConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
