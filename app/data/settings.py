"""What `pretrain prepare` takes (PrepareConfig), its checks, and how many workers it may use."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.data.shards import dtype_for_vocab
from app.data.tokenizer import check_bpe_vocab
from app.errors import UserError

PIPELINE_VERSION = 1  # bump when the same settings would produce different shards


@dataclass
class PrepareConfig:
    """Everything `pretrain prepare` takes; each field's comment is the help of its flag (app/data/cli.py)."""

    # text to prepare: a parquet/jsonl(.gz/.zst)/txt file, a directory of them, a glob, or a HF Hub dataset
    # (e.g. hf://datasets/HuggingFaceFW/fineweb-edu?include=sample/10BT/*.parquet); repeat to combine inputs
    inputs: list[str]
    out_dir: Path  # output dir for shards, tokenizer and manifest
    text_column: str = "text"  # parquet column / jsonl field holding the text
    # the tokenizer: bpe (train a byte-level BPE on a sample of the input), char (a character vocabulary),
    # PATH (a tokenizer.json, or a dir holding one, e.g. another data dir) or hf://OWNER/NAME (the
    # tokenizer.json of a Hub model repo, e.g. hf://openai-community/gpt2)
    tokenizer: str = "bpe"
    vocab_size: int = 32768  # BPE vocabulary size to train
    sample_bytes: int = 256 * 10**6  # train the tokenizer on the first N bytes of training documents
    # with --tokenizer char: a fixed alphabet (other characters map to one unknown id) instead of the
    # characters seen in the sample
    char_alphabet: str = ""
    val_fraction: float = 0.01  # share of documents held out for validation: every round(1/F)-th document
    shard_tokens: int = 50_000_000  # tokens per shard
    dtype: str = "auto"  # token id width on disk; auto = uint16 when the vocabulary fits
    workers: int = 0  # tokenizer processes; 0 = every core this process may use
    # how .txt inputs become documents: one per file, one per line, or runs of blank-line separated
    # paragraphs of about --doc-chars characters
    txt_split: str = "file"
    doc_chars: int = 4000  # document size for --txt-split paragraph
    # for hf:// inputs: only files matching GLOB (repeatable; the same as ?include=GLOB)
    includes: list[str] = field(default_factory=list)
    revision: str | None = None  # for hf:// inputs: branch, tag or commit (default: main)
    # where Hub downloads are cached and resumed (default: HF_HUB_CACHE or ~/.cache/huggingface/hub)
    cache_dir: str | None = None
    verify: str = "sha256"  # how a re-run checks shards already written before skipping them: sha256 | size
    # progress display: a bar on a terminal, else a log line every --log-every seconds
    progress: str = "auto"
    log_every: float = 30.0  # seconds between progress log lines
    # A sharded prepare (app/data/shares.py): the input cut into shard_count shares; this process tokenizes
    # share shard_index, or with finalize joins the finished shares. Not settings: the content is the same.

    # cut the input into N shares that N processes (or an Indexed Job's pods) tokenize at once, each into
    # DATA_DIR/shares/N/I; then --finalize joins them (1: one process does it all)
    shard_count: int = 1
    # with --shard-count N: the share this process tokenizes, 0..N-1 (default: $JOB_COMPLETION_INDEX)
    shard_index: int = 0
    # with --shard-count N: join the N finished shares into DATA_DIR (manifest, tokenizer) with the same
    # arguments they were made with; the token stream and validation split are a one-process prepare's
    finalize: bool = False

    def settings(self) -> dict:
        """What determines the shards' content; a re-run with different settings refuses to mix them."""
        s: dict = {
            "pipeline": PIPELINE_VERSION,
            "text_column": self.text_column,
            "val_fraction": self.val_fraction,
            "shard_tokens": self.shard_tokens,
            "dtype": self.dtype,
            "txt_split": self.txt_split,
        }
        if self.txt_split == "paragraph":
            s["doc_chars"] = self.doc_chars
        if self.tokenizer == "bpe":
            s["tokenizer"] = {
                "train": "bpe",
                "vocab_size": self.vocab_size,
                "sample_bytes": self.sample_bytes,
            }
        elif self.tokenizer == "char":
            sample = 0 if self.char_alphabet else self.sample_bytes  # a fixed alphabet reads no sample
            s["tokenizer"] = {"train": "char", "alphabet": self.char_alphabet, "sample_bytes": sample}
        else:
            s["tokenizer"] = {"load": True}
        return s


def check_config(cfg: PrepareConfig) -> None:
    if not cfg.inputs:
        raise UserError("no input: pass --input PATH or --input hf://datasets/OWNER/NAME")
    if not 0 < cfg.val_fraction < 0.5:
        raise UserError(f"--val-fraction must be in (0, 0.5), got {cfg.val_fraction}")
    if cfg.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be >= 1, got {cfg.shard_tokens}")
    if cfg.dtype not in ("auto", "uint16", "uint32"):
        raise UserError(f"--dtype must be auto, uint16 or uint32, got {cfg.dtype}")
    if cfg.tokenizer == "bpe":
        check_bpe_vocab(cfg.vocab_size)
        check_dtype(cfg.vocab_size, cfg.dtype)
    if cfg.txt_split not in ("file", "line", "paragraph"):
        raise UserError(f"--txt-split must be file, line or paragraph, got {cfg.txt_split}")
    if cfg.verify not in ("sha256", "size"):
        raise UserError(f"--verify must be sha256 or size, got {cfg.verify}")
    if cfg.sample_bytes < 1:
        raise UserError(f"--tokenizer-sample-bytes must be >= 1, got {cfg.sample_bytes}")
    if cfg.shard_count < 1:
        raise UserError(f"--shard-count must be >= 1, got {cfg.shard_count}")
    if not 0 <= cfg.shard_index < cfg.shard_count:
        raise UserError(
            f"--shard-index must be in 0..{cfg.shard_count - 1} (--shard-count {cfg.shard_count}), got {cfg.shard_index}"
        )
    if cfg.finalize and cfg.shard_count == 1:
        raise UserError(
            "--finalize joins the shares of a sharded prepare: give their --shard-count N (N > 1)"
        )


def check_dtype(vocab_size: int, dtype: str) -> np.dtype:
    if dtype == "uint16" and vocab_size > 2**16:
        raise UserError(
            f"a vocabulary of {vocab_size} tokens does not fit --dtype uint16 (at most 65536); "
            "use --dtype uint32 or auto"
        )
    if vocab_size > 2**32:
        raise UserError(f"a vocabulary of {vocab_size} tokens does not fit uint32 token ids")
    return np.dtype(dtype) if dtype != "auto" else dtype_for_vocab(vocab_size)


def default_workers() -> int:
    """Cores this process may use: CPU affinity, capped by a cgroup CPU quota (a Kubernetes CPU limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def _cgroup_cpu_quota() -> int:
    """ceil(quota / period) from cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`; 0 when unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return 0 if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return math.ceil(quota / period) if quota > 0 and period > 0 else 0
    except (OSError, ValueError):
        return 0
