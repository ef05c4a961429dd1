"""`pretrain`: one CLI for the whole job. Each subcommand's flags live beside the code they drive.

Exit codes: 0 done; 2 bad input, config or data (one line on stderr, no traceback);
128 + signal number when preempted (SIGTERM -> 143), which Kubernetes' ExitCode policy retries.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from app.errors import UserError

EPILOG = """\
examples:
  pretrain train                                   # tiny model, embedded Shakespeare, CPU
  pretrain train --preset x1-50m --set data.dataset=/data/fineweb --print-config
  pretrain sample --checkpoint runs/tiny --prompt "ROMEO."
  pretrain prepare --input corpus/ --out data/mine --vocab-size 8192
  pretrain plan --budget-usd 35 --gpu a100-80gb --gpus 1
  pretrain watch --cap-usd 1000 --gpu-type h100-sxm --gpus 8 --run-dir /ckpt/run

exit codes: 0 done (planned end, budget stop, early stop); 2 bad input or config;
            128+N preempted by signal N (retryable); 1 unexpected error.
"""


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from app.config import preset_names

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
        help="override one config key, dotted (e.g. --set model.n_layer=8); repeatable",
    )
    p.add_argument(
        "--out",
        default="runs/tiny",
        metavar="RUN_DIR",
        help="run directory: checkpoints/, metrics.jsonl, status.json, budget/ (default: runs/tiny)",
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


def _run_train(args: argparse.Namespace) -> int:
    from app.config import load_config

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
        },
    )
    if cfg.metrics.port and cfg.budget.cap_usd and not cfg.budget.metrics_port:
        cfg.budget.metrics_port = cfg.metrics.port + 1  # the in-process watcher's own /metrics
    if args.print_config:
        return _print_config(cfg)
    from app.train import RunArgs, train

    return train(cfg, RunArgs(Path(args.out), args.resume, Path(args.stop_file) if args.stop_file else None))


def _print_config(cfg) -> int:
    import yaml

    from app.metrics import flops_per_token
    from app.model import count_parameters

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    if not cfg.model.vocab_size:  # from the data; embedded BPE gets data.vocab_size
        cfg.model.vocab_size = cfg.data.vocab_size if cfg.data.tokenizer == "bpe" else 128
        note = f" (vocab from the data; counted with {cfg.model.vocab_size})"
    else:
        note = ""
    counts = count_parameters(cfg.model)
    print(f"# parameters: {counts.total:,} total, {counts.non_embedding:,} non-embedding{note}")
    print(f"# training FLOPs per token: {flops_per_token(cfg.model):,.0f}")
    from app.memory import planned_world_size, print_lines

    print("\n".join(print_lines(cfg, planned_world_size(cfg))))
    return 0


def _add_sample_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="RUN_DIR|CKPT_DIR",
        help="a run dir (its newest valid checkpoint) or a checkpoints/step_NNNNNN dir",
    )
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument(
        "--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (default 0.8)")
    p.add_argument(
        "--top-k", type=int, default=50, help="sample among the k likeliest tokens (default 50; 0 = all)"
    )
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="independent samples (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def _run_sample(args: argparse.Namespace) -> int:
    from app.sample import sample

    for text in sample(
        args.checkpoint,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.num_samples,
        args.seed,
    ):
        print(text)
        print("-" * 40)
    return 0


# name -> (help, add_arguments, run); the others live beside their code.
_LOCAL = {
    "train": ("train a model (locally, or under torchrun / Kubernetes)", _add_train_arguments, _run_train),
    "sample": ("generate text from a checkpoint", _add_sample_arguments, _run_sample),
}
_MODULES = {
    "prepare": ("app.data.cli", "tokenize raw text (HF Hub or local files) into training shards"),
    "watch": ("app.budget.cli", "watch spend against a budget cap; stop the trainer before it is crossed"),
    "plan": ("app.plan", "what model, tokens and hours a budget buys (Chinchilla)"),
    "export": ("app.export", "export a run: manifest, metrics CSV, plots, final weights"),
}
ORDER = ["train", "prepare", "watch", "plan", "sample", "export"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        raise UserError(f"{self.prog}: {message} (see --help)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported: `pretrain watch` starts without loading torch."""
    parser = _Parser(
        prog="pretrain",
        description="LLM pretraining that trains the best model a dollar "
        "budget buys, survives preemption, and reports loss, throughput and spend.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from app import __version__

    parser.add_argument("--version", action="version", version=f"pretrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in ORDER:
        if name in _LOCAL:
            help_, add, run = _LOCAL[name]
        else:
            module, help_ = _MODULES[name]
            if name != command:
                sub.add_parser(name, help=help_, description=help_)
                continue
            mod = importlib.import_module(module)
            add, run = mod.add_arguments, mod.run
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command or name in _LOCAL:
            add(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        command = next((a for a in argv if not a.startswith("-")), None)
        parser = build_parser(command)
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
