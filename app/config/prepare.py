"""What `pretrain prepare` takes (`PrepareConfig`): each field's comment is the help of its flag
(app/data/cli.py generates them, app/config/flags.py); its checks are app/data/settings.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

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
