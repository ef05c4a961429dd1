"""The planning step: what a resolved config needs before anything is built, run by each command after it
parses its flags (`pretrain train` and its `--print-config`, `pretrain bench`). Parsing only reads the
command line into a config; the estimates live here:

1. `--print-config` told no GPUs (no --gpus, --gpu-type, budget.gpus or GPU type in the config, no torchrun)
   plans for the config's own `plan:` GPUs, as if given --gpus N --gpu-type T;
2. the size check: a model whose weights, gradients and optimizer state alone exceed one device is
   refused in one line (app/trainer/parallel/memory.py's estimate: arithmetic, seconds);
3. a GPU type named: the micro-batch x accumulation that fits it at the planned world size
   (app/trainer/parallel/layout.py), unless the command line set train.micro_batch_size.
"""

from __future__ import annotations

import dataclasses
import os

from app.config import Config, vocab_for_estimates
from app.errors import UserError

MORE_GPUS = "plan for more or larger GPUs (--gpus N --gpu-type T)"  # the size check's fix for train


def plan(
    cfg: Config,
    gpu_type: str | None = None,
    micro_batch_set: bool = False,
    printing: bool = False,
    more_gpus: str = MORE_GPUS,
) -> None:
    """The planning step, in place on `cfg`: `gpu_type` is --gpu-type, `micro_batch_set` whether the
    command line set train.micro_batch_size, `printing` whether this is --print-config, `more_gpus` the
    command's own way to a larger machine (said when the model does not fit)."""
    layout_for = "--gpu-type" if gpu_type else ""
    if printing and not gpu_type and not _gpus_named(cfg) and (cfg.plan.gpus or cfg.plan.gpu_type):
        cfg.budget.gpus = cfg.plan.gpus
        cfg.budget.gpu_type = cfg.metrics.gpu_type = gpu_type = cfg.plan.gpu_type
        layout_for = "plan.gpu_type, the GPUs the config is made for (--gpus N --gpu-type T plan for others)"
        if not gpu_type:
            print(
                f"# planned for plan.gpus={cfg.plan.gpus} GPUs, the config's own (--gpus N plans for others)"
            )
    # before anything is built: an absurd size is refused in seconds, not after minutes
    check_size(cfg, printing, more_gpus)
    if gpu_type and not micro_batch_set:
        apply_layout(cfg, layout_for)


def _gpus_named(cfg: Config) -> bool:
    """Whether the command line, the config or torchrun says which GPUs the run has."""
    world = os.environ.get("WORLD_SIZE", "")
    return bool(cfg.budget.gpus or cfg.budget.gpu_type or cfg.metrics.gpu_type or world.isdigit())


def check_size(cfg: Config, printing: bool = False, more_gpus: str = MORE_GPUS) -> None:
    """Refuse (one line, exit 2) a model whose weights, gradients and optimizer state alone, sharded over
    every planned rank, exceed one device's memory: it can never train, whatever the batch, and building
    its parameter tables (for --print-config, or at start) would take minutes. Arithmetic only (the
    memory estimate); the device is the one --print-config plans for; none known: the largest known GPU
    for CUDA and for `printing` (--print-config is how a GPU run is prepared, often on a laptop: its
    printout says when this machine cannot train it), else this machine."""
    from app.trainer.parallel import memory

    world = memory.planned_world_size(cfg)
    cuda = memory.plans_for_cuda(cfg)
    sized = dataclasses.replace(cfg.model, vocab_size=vocab_for_estimates(cfg))
    static = memory.estimate(sized, 1, "fsdp", world, cuda=cuda, optimizer=cfg.optim.name).static
    have, where = memory.device_memory_bytes(cfg)
    if have is None and (cuda or printing):
        largest = max(memory.GPU_MEMORY_GB, key=memory.GPU_MEMORY_GB.get)
        have = int(memory.GPU_MEMORY_GB[largest] * memory.GB)
        where = f"the largest GPU known ({largest})"
    elif have is None:
        have = memory.host_memory_bytes()
        where = "this machine"
    if static > have:
        sharded = f"sharded over {world} ranks" if world > 1 else "on one rank"
        raise UserError(
            "the model does not fit, whatever the batch: its weights, gradients and optimizer state alone are "
            f"{static / memory.GB:,.0f} GB per rank ({sharded}), above the {have / memory.GB:,.0f} GB of "
            f"{where}; {_largest_part(sized)}, or {more_gpus}"
        )


def _largest_part(m) -> str:
    """The fix for a model too big to train: shrink whichever of its parts is the largest."""
    from app.trainer.parallel.memory import param_split

    split = param_split(m)
    embedding_and_head = m.padded_vocab * m.d_model * (1 if m.tie_embeddings else 2)
    parts = {
        "make model.n_layer or model.d_model smaller": split.total - split.root,
        "make model.vocab_size smaller (the embedding and head are most of it)": embedding_and_head,
        "make model.value_embeds smaller (the value-embedding tables are most of it)": split.root
        - embedding_and_head,
    }
    return max(parts, key=parts.get)


def apply_layout(cfg: Config, named_by: str = "--gpu-type") -> None:
    """The batch layout for budget.gpu_type at the planned world size (app/trainer/parallel/layout.py), said in a
    YAML comment (so --print-config's output stays YAML) naming what chose the GPU type."""
    from app.trainer.parallel import layout
    from app.trainer.parallel.memory import planned_world_size

    sized = dataclasses.replace(cfg.model, vocab_size=vocab_for_estimates(cfg))  # the data's is not known yet
    chosen = layout.fit(dataclasses.replace(cfg, model=sized), cfg.budget.gpu_type, planned_world_size(cfg))
    layout.apply(cfg, chosen)
    if os.environ.get("RANK", "0") == "0":
        print(f"# batch layout for {named_by}: {chosen.describe()}", flush=True)
