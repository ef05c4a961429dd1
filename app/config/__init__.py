"""Typed run config in one home: one dataclass per section (model, data, train, optim, schedule,
checkpoint, metrics, budget, drill, plan, and `pretrain prepare`'s PrepareConfig), the loader (presets,
`--config`, `--set`), the checks, and each field's comment as its help (docs.py: the flags, docs/config.md).

The rest of the code imports from here (`from app.config import Config, ...`, the re-exports below). A
module inside the package imports its siblings directly (app.config.model, ...), never this __init__, so
the package has no import circle.
"""

from app.config.budget import BudgetConfig
from app.config.checkpoint import CheckpointConfig
from app.config.data import DataConfig
from app.config.drill import DrillConfig
from app.config.loader import (
    FROM_CHECKPOINT,
    MOVED,
    all_keys,
    apply_overrides,
    config_from_dict,
    load_config,
    merge_into,
    suggest_key,
    vocab_for_estimates,
)
from app.config.metrics import MetricsConfig
from app.config.model import LoopConfig, ModelConfig
from app.config.optim import OptimConfig
from app.config.plan import PlanConfig
from app.config.prepare import PrepareConfig
from app.config.presets import PRESET_DIR, load_yaml, preset_names
from app.config.root import DEFAULT_PRESET, Config
from app.config.schedule import ScheduleConfig
from app.config.train import TrainConfig
from app.errors import ConfigError

__all__ = [
    "DEFAULT_PRESET",
    "FROM_CHECKPOINT",
    "MOVED",
    "PRESET_DIR",
    "BudgetConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DrillConfig",
    "LoopConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "PlanConfig",
    "PrepareConfig",
    "ScheduleConfig",
    "TrainConfig",
    "all_keys",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "load_yaml",
    "merge_into",
    "preset_names",
    "suggest_key",
    "vocab_for_estimates",
]
