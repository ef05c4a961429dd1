"""What a run trains on (`data:`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    """What the run trains on: the embedded corpus, or a data dir written by `pretrain prepare`."""

    # "embedded" (Shakespeare, built on first use) or a `pretrain prepare` output dir
    dataset: str = "embedded"
    tokenizer: str = "bpe"  # embedded only: the tokenizer, bpe | char
    vocab_size: int = 2048  # embedded BPE vocabulary size
    cache_dir: str = ""  # embedded data cache; "" = $PRETRAIN_CACHE or ~/.cache/pretrain
    val_fraction: float = 0.02  # embedded only: share of documents held out for validation
    # training windows start at a document boundary (its <|endoftext|>, as the record's BOS); docs/recipes.md
    align_to_documents: bool = False
