"""`pretrain prepare`: arguments and entry point. app/cli.py adds these arguments to its `prepare`
subcommand and calls `run`; `python -m app.data.cli` runs it standalone."""

from __future__ import annotations

import argparse
import sys

from app.errors import UserError

DESCRIPTION = "Turn raw text (local files or a HF Hub dataset) into token shards for `pretrain train`."
_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _count(text: str) -> int:
    """An integer with an optional k/M/G/T suffix (decimal): 50M = 50,000,000."""
    t = text.strip().replace("_", "").lower()
    scale = _SUFFIX.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1].rstrip("b")
    elif t.endswith("b"):
        t = t[:-1]
    try:
        return int(float(t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 50000000 or 50M, got {text!r}") from None


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
    p.add_argument(
        "--text-column", default="text", help="parquet column / jsonl field holding the text (default: text)"
    )
    p.add_argument(
        "--tokenizer",
        default="bpe",
        metavar="bpe|char|PATH|hf://OWNER/NAME",
        help="bpe: train a byte-level BPE on a sample of the input (default); char: a character vocabulary; PATH: a "
        "tokenizer.json (or a dir holding one, e.g. another data dir); hf://OWNER/NAME: the tokenizer.json of a Hub "
        "model repo (e.g. hf://openai-community/gpt2)",
    )
    p.add_argument(
        "--vocab-size", type=_count, default=None, help="BPE vocabulary size to train (default: 32768)"
    )
    p.add_argument(
        "--tokenizer-sample-bytes",
        type=_count,
        default=256 * 10**6,
        metavar="N",
        help="train the tokenizer on the first N bytes of training documents (default: 256M)",
    )
    p.add_argument(
        "--char-alphabet",
        default="",
        metavar="CHARS",
        help="with --tokenizer char: a fixed alphabet (other characters map to one unknown id) instead of the "
        "characters seen in the sample",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="share of documents held out for validation: every round(1/F)-th document (default: 0.01)",
    )
    p.add_argument("--shard-tokens", type=_count, default=50 * 10**6, help="tokens per shard (default: 50M)")
    p.add_argument(
        "--dtype",
        choices=("auto", "uint16", "uint32"),
        default="auto",
        help="token id width on disk; auto = uint16 when the vocabulary fits (default: auto)",
    )
    p.add_argument(
        "--workers", type=int, default=0, help="tokenizer processes (default: 0 = every available core)"
    )
    p.add_argument(
        "--txt-split",
        choices=("file", "line", "paragraph"),
        default="file",
        help="how .txt inputs become documents: one per file (default), one per line, or runs of blank-line "
        "separated paragraphs of about --doc-chars characters",
    )
    p.add_argument("--doc-chars", type=_count, default=4000, help="document size for --txt-split paragraph")
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="for hf:// inputs: only files matching GLOB (repeatable; same as ?include=GLOB)",
    )
    p.add_argument("--revision", default=None, help="for hf:// inputs: branch, tag or commit (default: main)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where Hub downloads are cached and resumed (default: HF_HUB_CACHE or ~/.cache/huggingface/hub)",
    )
    p.add_argument(
        "--verify",
        choices=("sha256", "size"),
        default="sha256",
        help="how a re-run checks shards already written before skipping them (default: sha256)",
    )
    p.add_argument(
        "--progress",
        choices=("auto", "bar", "log", "none"),
        default="auto",
        help="progress display: a bar on a terminal, else a log line every --log-every seconds (default: auto)",
    )
    p.add_argument(
        "--log-every", type=float, default=30.0, help="seconds between progress log lines (default: 30)"
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
    renamed = {
        "inputs": list(args.input),
        "out_dir": args.out,
        "vocab_size": args.vocab_size if args.vocab_size is not None else 32768,
        "sample_bytes": args.tokenizer_sample_bytes,
        "includes": list(args.include),
    }
    return from_dict(PrepareConfig, {**vars(args), **renamed})  # the other options are named like its fields


def run(args: argparse.Namespace) -> int:
    """Prepare the data dir; raises UserError (the caller prints it and exits 2) on bad input."""
    from app.data.prepare import prepare

    prepare(config_from_args(args), log=lambda line: print(line, flush=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    from app.command import main_for

    return main_for("pretrain prepare", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
