"""`pretrain train` flags (also `python -m app.train` under torchrun), the config they resolve to, and
`--print-config`. A flag that sets a config key takes its help from the key's field (app/config_docs.py)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from app.budget.config import flag_for
from app.config import Config, load_config, preset_names, vocab_for_estimates
from app.config_checks import get_key
from app.config_docs import field_help, flag_help, help_for
from app.errors import UserError

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


# The flags that set one config key each (their help is the key's comment, app/config_docs.py); the budget's
# are named as `pretrain watch` names them (app.budget.config.flag_for).
CONFIG_FLAGS = {
    "train.max_steps": ("--max-steps", "N"),
    "metrics.port": ("--metrics-port", "PORT"),
    "budget.cap_usd": (flag_for("cap_usd"), "X"),
    "budget.price_per_gpu_hour": (flag_for("price_per_gpu_hour"), "P"),
    "budget.gpus": (flag_for("gpus"), "N"),
    "budget.max_price_per_gpu_hour": (flag_for("max_price_per_gpu_hour"), "USD"),
}
GPU_TYPE_HELP = (
    "GPU type (b200, h200, h100-sxm, a100-80gb, ...): prices the run (budget.gpu_type), sets the MFU peak "
    "(metrics.gpu_type) and picks the micro-batch x accumulation that fits its memory at --gpus N (or the "
    "torchrun world size), as `pretrain plan --preset P` prints it; an explicit --set train.micro_batch_size "
    "wins"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    run_help = field_help(RunArgs)
    p.add_argument("--out", metavar="RUN_DIR", help=flag_help(run_help["out"]))
    defaults = Config()
    for key, (flag, metavar) in CONFIG_FLAGS.items():
        kind = type(get_key(defaults, key))
        p.add_argument(flag, type=kind, metavar=metavar, help=flag_help(help_for(key)) + f" ({key})")
    p.add_argument("--resume", metavar="auto|never|PATH", default="auto", help=flag_help(run_help["resume"]))
    p.add_argument("--stop-file", metavar="PATH", help=flag_help(run_help["stop_file"]))
    p.add_argument("--gpu-type", metavar="T", help=GPU_TYPE_HELP)
    p.add_argument("--overwrite", action="store_true", help=flag_help(run_help["overwrite"]))
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
            **{key: getattr(args, flag_dest(flag)) for key, (flag, _) in CONFIG_FLAGS.items()},
            "budget.gpu_type": args.gpu_type,
            "metrics.gpu_type": args.gpu_type,
        },
    )
    # before anything is built: an absurd size is refused in seconds, not after minutes
    check_size(cfg, printing=getattr(args, "print_config", False))
    if args.gpu_type:
        _apply_layout(cfg, args)
    if cfg.metrics.port and cfg.budget.cap_usd and not cfg.budget.metrics_port:
        cfg.budget.metrics_port = cfg.metrics.port + 1  # the in-process watcher's own /metrics
    from app.trainer.trackers import check_trackers

    check_trackers(cfg.metrics.trackers)  # a missing extra: exit 2 before any work, on every rank
    return cfg


def flag_dest(flag: str) -> str:
    """argparse's attribute for a flag: --max-steps -> max_steps."""
    return flag.removeprefix("--").replace("-", "_")


def check_size(cfg: Config, printing: bool = False) -> None:
    """Refuse (one line, exit 2) a model whose weights, gradients and optimizer state alone, sharded over
    every planned rank, exceed one device's memory: it can never train, whatever the batch, and building
    its parameter tables (for --print-config, or at start) would take minutes. Arithmetic only (the
    memory estimate); the device is the one --print-config plans for; none known: the largest known GPU
    for CUDA and for `printing` (--print-config is how a GPU run is prepared, often on a laptop: its
    printout says when this machine cannot train it), else this machine."""
    import dataclasses

    from app.trainer import memory

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
            f"{where}; {_largest_part(sized)}, or plan for more or larger GPUs (--gpus N --gpu-type T)"
        )


def _largest_part(m) -> str:
    """The fix for a model too big to train: shrink whichever of its parts is the largest."""
    from app.trainer.memory import param_split

    split = param_split(m)
    embedding_and_head = m.padded_vocab * m.d_model * (1 if m.tie_embeddings else 2)
    parts = {
        "make model.n_layer or model.d_model smaller": split.total - split.root,
        "make model.vocab_size smaller (the embedding and head are most of it)": embedding_and_head,
        "make model.value_embeds smaller (the value-embedding tables are most of it)": split.root
        - embedding_and_head,
    }
    return max(parts, key=parts.get)


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
    cfg.model.vocab_size = vocab_for_estimates(cfg)
    from app.trainer.model import build_model

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
    from app.trainer.memory import plans_for_cuda
    from app.trainer.runtime import describe

    print("\n".join(describe(cfg, plans_for_cuda(cfg))))
    from app.trainer.optim import describe_groups

    print("\n".join(describe_groups(model, cfg.optim)))
    return 0


def _auto_micro_batch_lines(cfg: Config) -> list[str]:
    """train.micro_batch_size=auto: the rule, and what it picks for the planned device (set in `cfg`)."""
    from app.trainer import layout, memory

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
