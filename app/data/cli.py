"""`pretrain prepare`: arguments and entry point. app/cli.py adds these arguments to its `prepare`
subcommand and calls `run`; `python -m app.data.cli` runs it standalone."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from app.command import count
from app.config_docs import field_help, flag_help
from app.errors import UserError

DESCRIPTION = "Turn raw text (local files or a HF Hub dataset) into token shards for `pretrain train`."

# flag, PrepareConfig field, type, metavar (None: from the flag); each flag's default is its field's
# default and its help is the field's comment (app/config_docs.py), and config_from_args maps the flags
# onto the fields
VALUE_FLAGS = [
    ("--text-column", "text_column", str, None),
    ("--tokenizer", "tokenizer", str, "bpe|char|PATH|hf://OWNER/NAME"),
    ("--vocab-size", "vocab_size", count, None),
    ("--tokenizer-sample-bytes", "sample_bytes", count, "N"),
    ("--char-alphabet", "char_alphabet", str, "CHARS"),
    ("--val-fraction", "val_fraction", float, None),
    ("--shard-tokens", "shard_tokens", count, None),
    ("--workers", "workers", int, None),
    ("--doc-chars", "doc_chars", count, None),
    ("--revision", "revision", str, None),
    ("--cache-dir", "cache_dir", str, None),
    ("--log-every", "log_every", float, None),
    ("--shard-count", "shard_count", int, "N"),
    ("--shard-index", "shard_index", int, "I"),
]
# flags whose absence is itself a setting: None when not given, the field's default applies after the checks
# (--vocab-size only with --tokenizer bpe; --shard-index from $JOB_COMPLETION_INDEX)
UNSET_IS_NONE = {"vocab_size", "shard_index"}

# flag, PrepareConfig field, choices (the first is the default)
CHOICE_FLAGS = [
    ("--dtype", "dtype", ("auto", "uint16", "uint32")),
    ("--txt-split", "txt_split", ("file", "line", "paragraph")),
    ("--verify", "verify", ("sha256", "size")),
    ("--progress", "progress", ("auto", "bar", "log", "none")),
]


def _shown(value):
    """A default as the help shows it: 50M for 50,000,000."""
    if isinstance(value, int) and value >= 10**6 and value % 10**6 == 0:
        return f"{value // 10**6}M"
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.data.settings import PrepareConfig

    helps = field_help(PrepareConfig)
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PATH|hf://datasets/OWNER/NAME[?include=GLOB]",
        help=flag_help(helps["inputs"]),
    )
    p.add_argument("--out", required=True, metavar="DATA_DIR", help=flag_help(helps["out_dir"]))
    defaults = {f.name: f.default for f in dataclasses.fields(PrepareConfig)}
    for flag, name, kind, metavar in VALUE_FLAGS:
        text = flag_help(helps[name], _shown(defaults[name]))
        default = None if name in UNSET_IS_NONE else defaults[name]
        p.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    for flag, name, choices in CHOICE_FLAGS:
        p.add_argument(flag, choices=choices, default=choices[0], help=flag_help(helps[name], choices[0]))
    p.add_argument(
        "--include", action="append", default=[], metavar="GLOB", help=flag_help(helps["includes"])
    )
    p.add_argument("--finalize", action="store_true", help=flag_help(helps["finalize"]))


def config_from_args(args: argparse.Namespace):
    from app.data.manifest import from_dict
    from app.data.settings import PrepareConfig

    if args.vocab_size is not None and args.tokenizer != "bpe":
        raise UserError("--vocab-size applies only when training a BPE tokenizer (--tokenizer bpe)")
    if args.char_alphabet and args.tokenizer != "char":
        raise UserError("--char-alphabet applies only with --tokenizer char")
    if args.workers < 0:
        raise UserError(f"--workers must be >= 0, got {args.workers}")
    index = args.shard_index
    if args.finalize and index is not None:
        raise UserError("--finalize joins every share: leave out --shard-index")
    if index is None and args.shard_count > 1 and not args.finalize:
        completion = os.environ.get("JOB_COMPLETION_INDEX", "")
        if not completion.isdigit():
            raise UserError(
                f"--shard-count {args.shard_count} needs --shard-index I (0..{args.shard_count - 1}) or "
                "$JOB_COMPLETION_INDEX (an Indexed Job's pods have it), or --finalize"
            )
        index = int(completion)
        if index >= args.shard_count:
            raise UserError(
                f"$JOB_COMPLETION_INDEX is {index}, not a share of --shard-count {args.shard_count} "
                f"(0..{args.shard_count - 1}): give the Indexed Job as many completions as shares"
            )
    renamed = {
        "inputs": list(args.input),
        "out_dir": args.out,
        "vocab_size": args.vocab_size if args.vocab_size is not None else PrepareConfig.vocab_size,
        "sample_bytes": args.tokenizer_sample_bytes,
        "includes": list(args.include),
        "shard_index": index or 0,
    }
    return from_dict(PrepareConfig, {**vars(args), **renamed})  # the other options are named like its fields


def run(args: argparse.Namespace) -> int:
    from app.data import shares

    shares.run(config_from_args(args), log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    from app.command import main_for

    sys.exit(main_for("pretrain prepare", DESCRIPTION, add_arguments, run))
