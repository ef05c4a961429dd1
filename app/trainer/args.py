"""`pretrain train` flags (also `python -m app.train` under torchrun), the config they resolve to, and
`--print-config`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from app.config import Config, load_config, preset_names, vocab_for_estimates
from app.errors import UserError

DESCRIPTION = "train a model (locally, or under torchrun / Kubernetes)"


@dataclass
class RunArgs:
    """Runtime choices that are not part of the model/training config."""

    out: Path
    resume: str = "auto"  # auto | never | PATH
    stop_file: Path | None = None
    overwrite: bool = False  # a fresh start in a used run dir moves the old run aside


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--preset, --config, --set: how a run's config is chosen (`pretrain train`, `pretrain bench`)."""
    p.add_argument("--preset", help=f"config preset: {', '.join(preset_names())} (default: tiny)")
    p.add_argument(
        "--config", metavar="FILE.yaml", help="YAML file of config keys (applied after the preset)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, dotted, e.g. --set model.n_layer=8, --set optim.name=muon, "
        "--set train.compile=false, --set metrics.trackers=tensorboard,mlflow; repeatable; "
        "--print-config lists every key",
    )


# flag, type, metavar, help: the value flags of `pretrain train` (each sets the config key it names)
VALUE_FLAGS = [
    (
        "--out",
        str,
        "RUN_DIR",
        "run directory: checkpoints/, metrics.jsonl, status.json, budget/ (default: runs/<preset>)",
    ),
    ("--max-steps", int, "N", "planned end after N optimizer steps (train.max_steps)"),
    (
        "--resume",
        str,
        "auto|never|PATH",
        "auto: continue from the newest valid checkpoint in RUN_DIR (default); "
        "never: start fresh; PATH: a run dir or a checkpoints/step_NNNNNN dir",
    ),
    (
        "--stop-file",
        str,
        "PATH",
        'poll this JSON file each step; {"mode": "graceful"|"immediate"} stops the run '
        "(default: RUN_DIR/stop.json)",
    ),
    ("--metrics-port", int, "PORT", "serve Prometheus /metrics on this port (metrics.port; 0 = off)"),
    ("--budget-cap-usd", float, "X", "stop gracefully before spend reaches X dollars (budget.cap_usd)"),
    (
        "--price-per-gpu-hour",
        float,
        "P",
        "price of one GPU-hour in dollars for static spend tracking (budget.price_per_gpu_hour)",
    ),
    ("--gpus", int, "N", "GPUs billed (budget.gpus; default: the world size)"),
    (
        "--max-price-per-gpu-hour",
        float,
        "USD",
        "launch price guard: do not start (exit 0) while a GPU-hour costs "
        "more (budget.max_price_per_gpu_hour)",
    ),
    (
        "--gpu-type",
        str,
        "T",
        "GPU type (b200, h200, h100-sxm, a100-80gb, ...): prices the run (budget.gpu_type), "
        "sets the MFU peak (metrics.gpu_type) and picks the micro-batch x accumulation that fits its memory at "
        "--gpus N (or the torchrun world size), as `pretrain plan --preset P` prints it; an explicit "
        "--set train.micro_batch_size wins",
    ),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    for flag, kind, metavar, text in VALUE_FLAGS:
        p.add_argument(
            flag, type=kind, metavar=metavar, help=text, default="auto" if flag == "--resume" else None
        )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="with --resume never (or PATH from another run) in a RUN_DIR that holds checkpoints: move the "
        "old run (checkpoints, metrics.jsonl, budget) aside into RUN_DIR/previous-<time>/ instead of refusing",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config and parameter counts, then exit",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = load_config(
        args.preset,
        args.config,
        args.overrides,
        {
            "train.max_steps": args.max_steps,
            "metrics.port": args.metrics_port,
            "budget.cap_usd": args.budget_cap_usd,
            "budget.price_per_gpu_hour": args.price_per_gpu_hour,
            "budget.gpus": args.gpus,
            "budget.max_price_per_gpu_hour": args.max_price_per_gpu_hour,
            "budget.gpu_type": args.gpu_type,
            "metrics.gpu_type": args.gpu_type,
        },
    )
    check_size(cfg)  # before anything is built: an absurd size is refused in seconds, not after minutes
    if args.gpu_type:
        _apply_layout(cfg, args)
    if cfg.metrics.port and cfg.budget.cap_usd and not cfg.budget.metrics_port:
        cfg.budget.metrics_port = cfg.metrics.port + 1  # the in-process watcher's own /metrics
    from app.trainer.trackers import check_trackers

    check_trackers(cfg.metrics.trackers)  # a missing extra: exit 2 before any work, on every rank
    return cfg


def check_size(cfg: Config) -> None:
    """Refuse (one line, exit 2) a model whose weights, gradients and optimizer state alone, sharded over
    every planned rank, exceed one device's memory: it can never train, whatever the batch, and building
    its parameter tables (for --print-config, or at start) would take minutes. Arithmetic only (the
    memory estimate); the device is the one --print-config plans for (unknown GPU: the largest known)."""
    import dataclasses

    from app.trainer import memory

    world, cuda = memory.planned_world_size(cfg), memory.plans_for_cuda(cfg)
    sized = dataclasses.replace(cfg.model, vocab_size=vocab_for_estimates(cfg))
    static = memory.estimate(sized, 1, "fsdp", world, cuda=cuda, optimizer=cfg.optim.name).static
    have, where = memory.device_memory_bytes(cfg)
    if have is None and cuda:
        largest = max(memory.GPU_MEMORY_GB, key=memory.GPU_MEMORY_GB.get)
        have, where = int(memory.GPU_MEMORY_GB[largest] * memory.GB), f"the largest GPU known ({largest})"
    elif have is None:
        have, where = memory.host_memory_bytes(), "this machine"
    if static > have:
        sharded = f"sharded over {world} ranks" if world > 1 else "on one rank"
        raise UserError(
            "the model does not fit, whatever the batch: its weights, gradients and optimizer state alone are "
            f"{static / memory.GB:,.0f} GB per rank ({sharded}), above the {have / memory.GB:,.0f} GB of {where}; make model.n_layer or "
            "model.d_model smaller, or plan for more or larger GPUs (--gpus N --gpu-type T)"
        )


def _apply_layout(cfg: Config, args: argparse.Namespace) -> None:
    """--gpu-type: the batch layout for that GPU at the planned world size (app/trainer/layout.py)."""
    import dataclasses

    from app.trainer import layout
    from app.trainer.memory import planned_world_size

    if any(o.strip().startswith("train.micro_batch_size") for o in args.overrides):
        return
    sized = dataclasses.replace(cfg.model, vocab_size=vocab_for_estimates(cfg))  # the data's is not known yet
    chosen = layout.fit(dataclasses.replace(cfg, model=sized), cfg.budget.gpu_type, planned_world_size(cfg))
    layout.apply(cfg, chosen)
    if os.environ.get("RANK", "0") == "0":  # a YAML comment, so --print-config's output stays YAML
        print(f"# batch layout for --gpu-type: {chosen.describe()}", flush=True)


def print_config(cfg: Config) -> int:
    import yaml

    from app.trainer.memory import planned_world_size, print_lines
    from app.trainer.metrics import flops_per_token
    from app.trainer.model import count_parameters

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    note = "" if cfg.model.vocab_size else f" (vocab from the data; counted with {vocab_for_estimates(cfg)})"
    cfg.model.vocab_size = m = vocab_for_estimates(cfg)
    from app.trainer.model import build_model

    model = build_model(cfg.model, "meta")  # once: counting and the optimizer groups both read it
    counts = count_parameters(model)
    print(f"# parameters: {counts.total:,} total, {counts.non_embedding:,} non-embedding{note}")
    print(
        f"# vocabulary: {m:,} tokens; embedding and head padded to {cfg.model.padded_vocab:,} rows "
        f"(model.vocab_multiple={cfg.model.vocab_multiple}): {counts.padding:,} of the parameters, never read"
    )
    print(f"# training FLOPs per token: {flops_per_token(cfg.model):,.0f}")
    if cfg.train.micro_batch_size == "auto":
        print("\n".join(_auto_micro_batch_lines(cfg)))
    print("\n".join(print_lines(cfg, planned_world_size(cfg))))
    from app.trainer.memory import plans_for_cuda
    from app.trainer.runtime import describe

    print("\n".join(describe(cfg, plans_for_cuda(cfg))))
    from app.trainer.optim import describe_groups

    print("\n".join(describe_groups(model, cfg.optim)))
    return 0


def _auto_micro_batch_lines(cfg: Config) -> list[str]:
    """train.micro_batch_size=auto: the rule, and what it picks for the planned device (set in `cfg`)."""
    from app.trainer import layout, memory

    world, cuda = memory.planned_world_size(cfg), memory.plans_for_cuda(cfg)
    have, where = memory.device_memory_bytes(cfg)
    if have is None:
        have, where = (
            (80 * memory.GB, "an 80 GB GPU")
            if cuda
            else (memory.host_memory_bytes(), "this machine's memory")
        )
        where += " (--gpu-type or train.device_memory_gb plans for yours)"
    chosen = layout.fit_memory(cfg, world, int(have), cuda, "GPU" if cuda else "CPU")
    cfg.train.micro_batch_size, cfg.train.activation_checkpointing = chosen.micro_batch, chosen.checkpointing
    return [
        "# micro-batch: auto = the largest divisor of batch_tokens / (seq_len x ranks) sequences whose memory "
        "estimate fits 90% of the device,",
        "#   the rest of batch_tokens by gradient accumulation; an out-of-memory error in the first steps "
        "halves it; a resume keeps it",
        f"#   planned for {where}: {chosen.describe()}",
    ]
