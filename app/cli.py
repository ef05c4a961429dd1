"""`pretrain`: one CLI for the whole job. Each subcommand's flags live beside the code they drive
(`add_arguments` and `run` in the module named below); only the chosen one is imported, so
`pretrain watch` starts without loading torch. EPILOG lists the exit codes (app/errors.py's table).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from app.command import Parser, guarded
from app.errors import exit_codes_help

# The examples, then every exit code from app/errors.py's table (the one description of them).
EPILOG = """\
examples:
  pretrain train                                   # tiny model, embedded Shakespeare, CPU
  pretrain train --preset x1-50m --set data.dataset=/data/fineweb --print-config
  pretrain sample --checkpoint runs/tiny --prompt "ROMEO."
  pretrain serve --checkpoint runs/tiny --port 8000
  pretrain push runs/tiny-hf --repo my-org/tiny --dry-run
  pretrain eval --checkpoint runs/tiny --tasks hellaswag --include-path my_tasks/
  pretrain prepare --input corpus/ --out data/mine --vocab-size 8192
  pretrain plan --budget-usd 35 --gpu a100-80gb --gpus 1
  pretrain bench --preset x1-50m                   # tokens/s, MFU, memory on this machine
  pretrain watch --budget-cap-usd 1000 --gpu-type h100-sxm --gpus 8 --run-dir /ckpt/run

""" + exit_codes_help()

# name -> (module with add_arguments/run, one-line help), in the order `pretrain --help` lists them.
COMMANDS = {
    "train": ("app.train", "train a model (locally, or under torchrun / Kubernetes)"),
    "prepare": ("app.data.cli", "tokenize raw text (HF Hub or local files) into training shards"),
    "watch": ("app.budget.cli", "watch spend against a budget cap; stop the trainer before it is crossed"),
    "wait-data": ("app.data.wait", "wait for the prepare Job's output; give up if it failed or is missing"),
    "plan": ("app.tools.plan", "what model, tokens and hours a budget buys (Chinchilla)"),
    "sample": ("app.tools.sample", "generate text from a checkpoint"),
    "export": ("app.tools.export", "export a run: its report, or a Hugging Face folder (--format hf)"),
    "push": ("app.tools.push", "publish an exported folder on the Hugging Face Hub"),
    "serve": ("app.tools.serve", "serve a checkpoint over an OpenAI-compatible completions and chat API"),
    "eval": ("app.tools.eval", "evaluate a checkpoint on lm-eval tasks or a local CORE-style bundle"),
    "bench": ("app.tools.bench", "measure tokens/s, MFU, memory and step-time breakdown on synthetic tokens"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(
        prog="pretrain",
        description="LLM pretraining that trains the best model a dollar "
        "budget buys, survives preemption, and reports loss, throughput and spend.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from app import __version__

    parser.add_argument("--version", action="version", version=f"pretrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def go() -> int:
        command = next((a for a in argv if not a.startswith("-")), None)
        parser = build_parser(command)
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        return args._run(args)

    return guarded(go)


if __name__ == "__main__":
    sys.exit(main())
