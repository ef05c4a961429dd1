"""`pretrain train` flags (also `python -m app.train` under torchrun), the config they resolve to, and
`--print-config`. A flag that sets a field is declared once, as a Flag naming it, and generated from the field
(app/config/flags.py: its type, default and help, the field's comment). Parsing only parses: the estimates
(the size check, the batch layout for --gpu-type, the config's own GPUs for --print-config) are the
planning step, `plan_run`, which `pretrain train` calls after parsing (app/trainer/planning.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from app.config import Config, load_config, preset_names, vocab_for_estimates
from app.config.budget import flag_for
from app.config.flags import Flag, add_flag, given

DESCRIPTION = "train a model (locally, or under torchrun / Kubernetes)"


@dataclass
class RunArgs:
    """Runtime choices that are not part of the model/training config (each comment is its flag's help)."""

    out: Path  # run directory: checkpoints/, metrics.jsonl, status.json, budget/ (default: runs/<preset>)
    # auto: continue from the newest valid checkpoint in RUN_DIR (default; damaged ones are skipped, and a
    # start whose every checkpoint is damaged is refused); never: start fresh; PATH: a run dir or a
    # checkpoints/step_NNNNNN dir
    resume: str = "auto"
    # poll this JSON file each step; {"mode": "graceful"|"immediate"} stops the run (default:
    # RUN_DIR/stop.json); a file, existing or not, in a directory that exists (a directory is refused)
    stop_file: Path | None = None
    # with --resume never (or PATH from another run) in a RUN_DIR that holds checkpoints: move the old run
    # (checkpoints, damaged ones included, metrics.jsonl, budget) aside into RUN_DIR/previous-<time>/
    # instead of refusing
    overwrite: bool = False


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--preset, --config, --set: how a run's config is chosen (`pretrain train`, `pretrain bench`)."""
    p.add_argument("--preset", help=f"config preset: {', '.join(preset_names())} (default: tiny)")
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of config keys (applied after the preset), or a checkpoint's meta.json: the whole "
        "config its run was trained with (resume a run of an older recipe with it)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, dotted, e.g. --set model.n_layer=8, --set optim.name=muon, "
        "--set train.compile=false, --set metrics.trackers=tensorboard,mlflow; repeatable; "
        "--print-config lists every key, docs/config.md explains each (the preset is chosen with --preset)",
    )


# The flags that set one config key each: not given, the preset's value stands. The budget's are named as
# `pretrain watch` names them (app.config.budget.flag_for).
CONFIG_FLAGS = (
    Flag("train.max_steps", "--max-steps", "N", unset=True),
    Flag("metrics.port", "--metrics-port", "PORT", unset=True),
    Flag("budget.cap_usd", flag_for("cap_usd"), "X", unset=True),
    Flag("budget.price_per_gpu_hour", flag_for("price_per_gpu_hour"), "P", unset=True),
    Flag("budget.gpus", flag_for("gpus"), "N", unset=True),
    Flag("budget.max_price_per_gpu_hour", flag_for("max_price_per_gpu_hour"), "USD", unset=True),
)
# The flags of RunArgs' fields, in the order --help lists them (CONFIG_FLAGS come after --out).
OUT_FLAG = Flag("out", metavar="RUN_DIR", unset=True)
RUN_FLAGS = (
    Flag("resume", metavar="auto|never|PATH"),
    Flag("stop_file", metavar="PATH", unset=True),
)
OVERWRITE_FLAG = Flag("overwrite")
GPU_TYPE_HELP = (
    "GPU type (b200, h200, h100-sxm, a100-80gb, ...): prices the run (budget.gpu_type), sets the MFU peak "
    "(metrics.gpu_type) and picks the micro-batch x accumulation that fits its memory at --gpus N (or the "
    "torchrun world size), as `pretrain plan --preset P` prints it; an explicit --set train.micro_batch_size "
    "wins"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_flag(p, RunArgs, OUT_FLAG, show_default=False)
    for spec in CONFIG_FLAGS:
        add_flag(p, Config, spec, show_default=False, show_key=True)
    for spec in RUN_FLAGS:
        add_flag(p, RunArgs, spec, show_default=False)
    p.add_argument("--gpu-type", metavar="T", help=GPU_TYPE_HELP)
    add_flag(p, RunArgs, OVERWRITE_FLAG, show_default=False)
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config, parameter counts and memory estimate, then exit; told no GPUs "
        "(--gpus, --gpu-type), it plans for those the config is made for (plan.gpus, plan.gpu_type)",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """The config the command line names: the preset, --config, --set and the flags, checked. No estimate
    here: `plan_run` is the step after."""
    cfg = load_config(
        args.preset,
        args.config,
        args.overrides,
        {**given(args, CONFIG_FLAGS), "budget.gpu_type": args.gpu_type, "metrics.gpu_type": args.gpu_type},
    )
    if cfg.metrics.port and cfg.budget.cap_usd and not cfg.budget.metrics_port:
        cfg.budget.metrics_port = cfg.metrics.port + 1  # the in-process watcher's own /metrics
    from app.trainer.reporting.trackers import check_trackers

    check_trackers(cfg.metrics.trackers)  # a missing extra: exit 2 before any work, on every rank
    return cfg


def plan_run(cfg: Config, args: argparse.Namespace) -> None:
    """The planning step of `pretrain train` and its --print-config, after parsing (app/trainer/planning.py):
    the config's own GPUs for --print-config, the size check, the batch layout for --gpu-type."""
    from app.trainer import planning

    micro_batch_set = any(o.strip().startswith("train.micro_batch_size") for o in args.overrides)
    planning.plan(cfg, args.gpu_type, micro_batch_set, getattr(args, "print_config", False))


def print_config(cfg: Config) -> int:
    import yaml

    from app.trainer.model.gpt import count_parameters
    from app.trainer.parallel.memory import planned_world_size, print_lines
    from app.trainer.reporting.metrics import flops_per_token

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    note = "" if cfg.model.vocab_size else f" (vocab from the data; counted with {vocab_for_estimates(cfg)})"
    cfg.model.vocab_size = vocab_for_estimates(cfg)
    from app.trainer.model.gpt import build_model

    model = build_model(cfg.model, "meta")  # once: counting and the optimizer groups both read it
    counts = count_parameters(model)
    print(f"# parameters: {counts.total:,} total, {counts.non_embedding:,} non-embedding{note}")
    print(
        f"# vocabulary: {cfg.model.vocab_size:,} tokens; embedding and head padded to "
        f"{cfg.model.padded_vocab:,} rows (model.vocab_multiple={cfg.model.vocab_multiple}): "
        f"{counts.padding:,} of the parameters, never read"
    )
    print(f"# training FLOPs per token: {flops_per_token(cfg.model):,.0f}")
    if cfg.train.micro_batch_size == "auto":
        print("\n".join(_auto_micro_batch_lines(cfg)))
    print("\n".join(print_lines(cfg, planned_world_size(cfg))))
    from app.trainer.parallel.memory import plans_for_cuda
    from app.trainer.parallel.runtime import describe

    print("\n".join(describe(cfg, plans_for_cuda(cfg))))
    from app.trainer.optimization.optimizer import describe_groups

    print("\n".join(describe_groups(model, cfg.optim)))
    return 0


def _auto_micro_batch_lines(cfg: Config) -> list[str]:
    """train.micro_batch_size=auto: the rule, and what it picks for the planned device (set in `cfg`)."""
    from app.trainer.parallel import layout, memory

    world = memory.planned_world_size(cfg)
    cuda = memory.plans_for_cuda(cfg)
    have, where = memory.device_memory_bytes(cfg)
    if have is None and cuda:
        have = 80 * memory.GB
        where = "an 80 GB GPU (--gpu-type or train.device_memory_gb plans for yours)"
    elif have is None:
        have = memory.host_memory_bytes()
        where = "this machine's memory (--gpu-type or train.device_memory_gb plans for yours)"
    chosen = layout.fit_memory(cfg, world, int(have), cuda, "GPU" if cuda else "CPU")
    cfg.train.micro_batch_size = chosen.micro_batch
    cfg.train.activation_checkpointing = chosen.checkpointing
    return [
        "# micro-batch: auto = the largest divisor of batch_tokens / (seq_len x ranks) sequences whose "
        "memory estimate fits 90% of the device,",
        "#   the rest of batch_tokens by gradient accumulation; an out-of-memory error in the first steps "
        "halves it; a resume keeps it",
        f"#   planned for {where}: {chosen.describe()}",
    ]
