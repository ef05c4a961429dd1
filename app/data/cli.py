"""`pretrain prepare`: arguments and entry point. app/cli.py adds these arguments to its `prepare`
subcommand and calls `run`; `python -m app.data.cli` runs it standalone."""

from __future__ import annotations

import argparse
import os
import sys

from app.errors import UserError

DESCRIPTION = "Turn raw text (local files or a HF Hub dataset) into token shards for `pretrain train`."
_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _count(text: str) -> int:
    """An integer with an optional k/M/G/T suffix (decimal): 50M = 50,000,000."""
    t = text.strip().replace("_", "").lower().removesuffix("b")  # 256MB = 256M
    scale = _SUFFIX.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        return int(float(t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 50000000 or 50M, got {text!r}") from None


# flag, type, default, metavar (None: from the flag), help; config_from_args maps them onto PrepareConfig
VALUE_FLAGS = [
    ("--text-column", str, "text", None, "parquet column / jsonl field holding the text (default: text)"),
    (
        "--tokenizer",
        str,
        "bpe",
        "bpe|char|PATH|hf://OWNER/NAME",
        "bpe: train a byte-level BPE on a sample of the "
        "input (default); char: a character vocabulary; PATH: a tokenizer.json (or a dir holding one, e.g. another "
        "data dir); hf://OWNER/NAME: the tokenizer.json of a Hub model repo (e.g. hf://openai-community/gpt2)",
    ),
    ("--vocab-size", _count, None, None, "BPE vocabulary size to train (default: 32768)"),
    (
        "--tokenizer-sample-bytes",
        _count,
        256 * 10**6,
        "N",
        "train the tokenizer on the first N bytes of training documents (default: 256M)",
    ),
    (
        "--char-alphabet",
        str,
        "",
        "CHARS",
        "with --tokenizer char: a fixed alphabet (other characters map to one "
        "unknown id) instead of the characters seen in the sample",
    ),
    (
        "--val-fraction",
        float,
        0.01,
        None,
        "share of documents held out for validation: every round(1/F)-th document (default: 0.01)",
    ),
    ("--shard-tokens", _count, 50 * 10**6, None, "tokens per shard (default: 50M)"),
    ("--workers", int, 0, None, "tokenizer processes (default: 0 = every available core)"),
    ("--doc-chars", _count, 4000, None, "document size for --txt-split paragraph"),
    ("--revision", str, None, None, "for hf:// inputs: branch, tag or commit (default: main)"),
    (
        "--cache-dir",
        str,
        None,
        None,
        "where Hub downloads are cached and resumed (default: HF_HUB_CACHE or ~/.cache/huggingface/hub)",
    ),
    ("--log-every", float, 30.0, None, "seconds between progress log lines (default: 30)"),
    (
        "--shard-count",
        int,
        1,
        "N",
        "cut the input into N shares that N processes (or an Indexed Job's pods) tokenize at once, each "
        "into DATA_DIR/shares/N/I; then --finalize joins them (default: 1, one process does it all)",
    ),
    (
        "--shard-index",
        int,
        None,
        "I",
        "with --shard-count N: the share this process tokenizes, 0..N-1 (default: $JOB_COMPLETION_INDEX)",
    ),
]

# flag, choices (the first is the default), help
CHOICE_FLAGS = [
    (
        "--dtype",
        ("auto", "uint16", "uint32"),
        "token id width on disk; auto = uint16 when the vocabulary fits (default: auto)",
    ),
    (
        "--txt-split",
        ("file", "line", "paragraph"),
        "how .txt inputs become documents: one per file (default), "
        "one per line, or runs of blank-line separated paragraphs of about --doc-chars characters",
    ),
    (
        "--verify",
        ("sha256", "size"),
        "how a re-run checks shards already written before skipping them (default: sha256)",
    ),
    (
        "--progress",
        ("auto", "bar", "log", "none"),
        "progress display: a bar on a terminal, else a log line every --log-every seconds (default: auto)",
    ),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PATH|hf://datasets/OWNER/NAME[?include=GLOB]",
        help="text to prepare: a parquet/jsonl(.gz/.zst)/txt file, a directory of them, a glob, or a HF Hub dataset "
        "(e.g. hf://datasets/HuggingFaceFW/fineweb-edu?include=sample/10BT/*.parquet). Repeat to combine inputs",
    )
    p.add_argument(
        "--out", required=True, metavar="DATA_DIR", help="output dir for shards, tokenizer and manifest"
    )
    for flag, kind, default, metavar, text in VALUE_FLAGS:
        p.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    for flag, choices, text in CHOICE_FLAGS:
        p.add_argument(flag, choices=choices, default=choices[0], help=text)
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="for hf:// inputs: only files matching GLOB (repeatable; same as ?include=GLOB)",
    )
    p.add_argument(
        "--finalize",
        action="store_true",
        help="with --shard-count N: join the N finished shares into DATA_DIR (manifest, tokenizer) with the "
        "same arguments they were made with; the token stream and validation split are a one-process prepare's",
    )


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
    renamed = {
        "inputs": list(args.input),
        "out_dir": args.out,
        "vocab_size": args.vocab_size if args.vocab_size is not None else 32768,
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
