"""`pretrain prepare`: arguments and entry point. app/cli.py adds these arguments to its `prepare`
subcommand and calls `run`; `python -m app.data.cli` runs it standalone."""

from __future__ import annotations

import argparse
import os
import sys

from app.command import count
from app.config import PrepareConfig
from app.config.flags import Flag, add_flags, given
from app.errors import UserError

DESCRIPTION = "Turn raw text (local files or a HF Hub dataset) into token shards for `pretrain train`."

# One flag per PrepareConfig field, in --help's order, generated from the field (app/config/flags.py): its
# type, its default (shown in the help) and its help, the field's comment. A Flag says only what the field
# does not: the flag's name where it differs, a metavar, `count` for sizes such as 50M, the choices.
PREPARE_FLAGS = (
    Flag("inputs", "--input", "PATH|hf://datasets/OWNER/NAME[?include=GLOB]"),
    Flag("out_dir", "--out", "DATA_DIR"),
    Flag("text_column"),
    Flag("tokenizer", metavar="bpe|char|PATH|hf://OWNER/NAME"),
    # not given: None, and the field's default applies after the checks (it is for --tokenizer bpe only)
    Flag("vocab_size", parse=count, unset=True),
    Flag("sample_bytes", "--tokenizer-sample-bytes", "N", parse=count),
    Flag("char_alphabet", metavar="CHARS"),
    Flag("val_fraction"),
    Flag("shard_tokens", parse=count),
    Flag("workers"),
    Flag("doc_chars", parse=count),
    Flag("revision"),
    Flag("cache_dir"),
    Flag("log_every"),
    Flag("shard_count", metavar="N"),
    Flag("shard_index", metavar="I", unset=True),  # not given: None, then $JOB_COMPLETION_INDEX or 0
    Flag("dtype", choices=("auto", "uint16", "uint32")),
    Flag("txt_split", choices=("file", "line", "paragraph")),
    Flag("verify", choices=("sha256", "size")),
    Flag("progress", choices=("auto", "bar", "log", "none")),
    Flag("includes", "--include", "GLOB"),
    Flag("finalize"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, PrepareConfig, PREPARE_FLAGS)


def config_from_args(args: argparse.Namespace) -> PrepareConfig:
    """PrepareConfig from the flags, with the rules between them (one line, exit 2, for a conflict)."""
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
    values = given(args, PREPARE_FLAGS)
    if values["vocab_size"] is None:
        values["vocab_size"] = PrepareConfig.vocab_size
    values["shard_index"] = index or 0
    return PrepareConfig(**values)


def run(args: argparse.Namespace) -> int:
    from app.data import shares

    shares.run(config_from_args(args), log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    from app.command import main_for

    sys.exit(main_for("pretrain prepare", DESCRIPTION, add_arguments, run))
