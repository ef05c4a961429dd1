"""`pretrain train` flags (also `python -m app.train` under torchrun), the config they resolve to, and
`--print-config`."""

from __future__ import annotations

import argparse
import os

from app.config import Config, load_config, preset_names, vocab_for_estimates

DESCRIPTION = "train a model (locally, or under torchrun / Kubernetes)"


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--out",
        metavar="RUN_DIR",
        help="run directory: checkpoints/, metrics.jsonl, status.json, budget/ (default: runs/<preset>)",
    )
    p.add_argument(
        "--max-steps", type=int, metavar="N", help="planned end after N optimizer steps (train.max_steps)"
    )
    p.add_argument(
        "--resume",
        default="auto",
        metavar="auto|never|PATH",
        help="auto: continue from the newest valid checkpoint in RUN_DIR (default); never: start "
        "fresh; PATH: a run dir or a checkpoints/step_NNNNNN dir",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="with --resume never (or PATH from another run) in a RUN_DIR that holds checkpoints: move the "
        "old run (checkpoints, metrics.jsonl, budget) aside into RUN_DIR/previous-<time>/ instead of refusing",
    )
    p.add_argument(
        "--stop-file",
        metavar="PATH",
        help='poll this JSON file each step; {"mode": "graceful"|"immediate"} stops the run '
        "(default: RUN_DIR/stop.json)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus /metrics on this port (metrics.port; 0 = off)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config and parameter counts, then exit",
    )
    p.add_argument(
        "--budget-cap-usd",
        type=float,
        metavar="X",
        help="stop gracefully before spend reaches X dollars (budget.cap_usd)",
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=float,
        metavar="P",
        help="price of one GPU-hour in dollars for static spend tracking (budget.price_per_gpu_hour)",
    )
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs billed (budget.gpus; default: the world size)")
    p.add_argument(
        "--max-price-per-gpu-hour",
        type=float,
        metavar="USD",
        help="launch price guard: do not start (exit 0) while a GPU-hour costs more (budget.max_price_per_gpu_hour)",
    )
    p.add_argument(
        "--gpu-type",
        metavar="T",
        help="GPU type (b200, h200, h100-sxm, a100-80gb, ...): prices the run (budget.gpu_type), sets the "
        "MFU peak (metrics.gpu_type) and picks the micro-batch x accumulation that fits its memory at "
        "--gpus N (or the torchrun world size), as `pretrain plan --preset P` prints it; an explicit "
        "--set train.micro_batch_size wins",
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
    if args.gpu_type:
        _apply_layout(cfg, args)
    if cfg.metrics.port and cfg.budget.cap_usd and not cfg.budget.metrics_port:
        cfg.budget.metrics_port = cfg.metrics.port + 1  # the in-process watcher's own /metrics
    from app.trainer.trackers import check_trackers

    check_trackers(cfg.metrics.trackers)  # a missing extra: exit 2 before any work, on every rank
    return cfg


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
    counts = count_parameters(cfg.model)
    print(f"# parameters: {counts.total:,} total, {counts.non_embedding:,} non-embedding{note}")
    print(f"# training FLOPs per token: {flops_per_token(cfg.model):,.0f}")
    print("\n".join(print_lines(cfg, planned_world_size(cfg))))
    from app.trainer.memory import plans_for_cuda
    from app.trainer.runtime import describe

    print("\n".join(describe(cfg, plans_for_cuda(cfg))))
    from app.trainer.model import build_model
    from app.trainer.optim import describe_groups

    print("\n".join(describe_groups(build_model(cfg.model, "meta"), cfg.optim)))
    return 0
