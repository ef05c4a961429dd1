"""Resume: which checkpoint a starting trainer continues from, and restoring its weights and optimizer
state into this run's model, whatever the parallel mode and world size it was saved with."""

from __future__ import annotations

import torch

from app.config import Config, config_from_dict
from app.trainer import checkpoint as ckpt
from app.trainer.optim import fit_state
from app.trainer.parallel import DistEnv, load_state
from app.trainer.schedule import DecayPlan, resume_change


def find_checkpoint(run_dir, spec: str, verify: str, is_rank0: bool, warn, log) -> ckpt.CheckpointInfo | None:
    """`--resume auto`: the newest checkpoint of the run dir that verifies (rank 0 sets newer, unusable
    step dirs aside so they shadow nothing); `never`: None; else a run dir or step dir."""
    if spec == "never":
        return None
    if spec == "auto":
        info = ckpt.resolve_latest(run_dir, verify, warn=warn)
        if is_rank0:
            ckpt.set_aside_newer(run_dir, info.step if info else -1, warn=warn)
    else:
        info = ckpt.resolve(spec, verify, warn=warn)
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
    """Collective. Rank 0 reads the full tensors; load_state broadcasts and re-shards them."""
    ckpt.check_compatible(model, ckpt.load_model_shapes(info), info.path)  # every rank, header only
    reads = env.is_rank0 or not env.distributed
    model_state = ckpt.load_model_state(info) if reads else {}
    opt_state = None
    if info.has_optimizer:
        opt_state = ckpt.load_optimizer_state(info) if reads else {}
        if opt_state:  # another optimizer mode or grouping: convert (or refuse in one line)
            opt_state, notes = fit_state(opt_state, optimizer, model)
            for note in notes:
                (warn if note.startswith("warning:") else log)(note)
    else:
        warn(f"warning: {info.path} has no optimizer state; the optimizer restarts from zero moments")
    load_state(model, optimizer, model_state, opt_state)
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
