"""Resume: which checkpoint a starting trainer continues from, and restoring its weights and optimizer
state into this run's model, whatever the parallel mode and world size it was saved with."""

from __future__ import annotations

import torch

from app.config import Config, config_from_dict
from app.trainer import checkpoint as ckpt
from app.trainer.parallel import DistEnv
from app.trainer.schedule import DecayPlan, resume_change


def find_checkpoint(run_dir, spec: str, verify: str, env: DistEnv, warn, log) -> ckpt.CheckpointInfo | None:
    """`--resume auto`: the newest checkpoint of the run dir that verifies (rank 0 sets newer, unusable
    step dirs aside so they shadow nothing); `never`: None; else a run dir or step dir. Collective: the
    ranks share the sha256 checks, each hashing 1/world of the files, and agree on the answer."""
    if spec == "never":
        return None
    shared = ckpt.Shared(env.rank, env.world_size, env.all_true) if env.distributed else None
    if spec == "auto":
        info = ckpt.resolve_latest(run_dir, verify, warn, shared)
        if env.is_rank0:
            ckpt.set_aside_newer(run_dir, info.step if info else -1, warn=warn)
    else:
        info = ckpt.resolve(spec, verify, warn, shared)
    if info is not None and info.step == 0:
        # Older versions saved step 0; nothing was learned and its optimizer state is not real.
        log(f"ignoring {info.path}: a step-0 checkpoint holds nothing a fresh start does not")
        return None
    return info


def restore_weights(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    info: ckpt.CheckpointInfo,
    env: DistEnv,
    warn,
    log,
) -> None:
    """Every rank reads only the boxes it holds (its FSDP shards, or whole tensors under DDP), from
    whatever world size and mode wrote them: no broadcast, no full copy anywhere. An optimizer state of
    another mode (AdamW <-> Muon) is converted, with a line saying so."""
    ckpt.check_compatible(model, ckpt.load_model_shapes(info), info.path)  # every rank, index only
    for note in ckpt.load_into(info, model, optimizer):
        (warn if note.startswith("warning:") else log)(note)
    if not info.has_optimizer:
        warn(f"warning: {info.path} has no optimizer state; the optimizer restarts from zero moments")
    saved_world = info.meta.get("world_size")
    if saved_world != env.world_size:
        log(
            f"resharding: checkpoint of world size {saved_world} on {env.world_size}: weights and "
            "optimizer restored exactly, data continues at the same global sample, RNG states start fresh"
        )
    rng = ckpt.load_rng_state(info, env.rank)
    if rng is not None and saved_world == env.world_size:
        ckpt.set_rng_state(rng)


def schedule_note(info: ckpt.CheckpointInfo, cfg: Config, budget_decay: dict | None) -> str | None:
    """Say so when this run's LR at the resumed step differs from the checkpoint's schedule."""
    old = config_from_dict(info.meta.get("config") or cfg.to_dict())
    return resume_change(
        (old.schedule, old.optim, old.train.max_steps),
        (cfg.schedule, cfg.optim, cfg.train.max_steps),
        info.step,
        DecayPlan(**budget_decay) if budget_decay else None,
    )
