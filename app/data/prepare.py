"""Raw text -> tokenizer -> token shards + validation split + manifest.json.

The manifest is the data dir's table of contents; the trainer reads only it and the shards.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from app.data.shards import dtype_for_vocab, write_shard
from app.data.tokenizer import Tokenizer, iter_batches

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass
class ShardInfo:
    file: str
    tokens: int
    documents: int
    bytes: int  # UTF-8 bytes of the text in this shard (for bits per byte)


@dataclass
class Manifest:
    tokenizer: dict
    dtype: str
    shard_tokens: int
    train: list[ShardInfo] = field(default_factory=list)
    val: list[ShardInfo] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    version: int = MANIFEST_VERSION

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    def split(self, name: str) -> list[ShardInfo]:
        return self.train if name == "train" else self.val

    def bytes_per_token(self, name: str) -> float:
        shards = self.split(name)
        tokens = sum(s.tokens for s in shards)
        return sum(s.bytes for s in shards) / tokens if tokens else 0.0

    def save(self, directory: Path) -> None:
        path = Path(directory) / MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        from app.errors import UserError

        path = Path(directory) / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(
                f"{directory} has no {MANIFEST}; create it with `pretrain prepare --out {directory}`"
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
        data["train"] = [ShardInfo(**s) for s in data.get("train", [])]
        data["val"] = [ShardInfo(**s) for s in data.get("val", [])]
        return cls(**data)


def is_val_document(index: int, val_fraction: float) -> bool:
    """Deterministic document-level split: every round(1/f)-th document goes to validation."""
    period = max(2, round(1 / val_fraction))
    return index % period == period - 1


class _ShardWriter:
    def __init__(self, out_dir: Path, split: str, shard_tokens: int, dtype: np.dtype) -> None:
        self.out_dir, self.split, self.shard_tokens, self.dtype = out_dir, split, shard_tokens, dtype
        self.buf: list[np.ndarray] = []
        self.buf_tokens = self.docs = self.bytes = 0
        self.shards: list[ShardInfo] = []

    def add(self, ids: list[int], nbytes: int) -> None:
        self.buf.append(np.asarray(ids, dtype=self.dtype))
        self.buf_tokens += len(ids)
        self.docs += 1
        self.bytes += nbytes
        if self.buf_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.buf_tokens:
            return
        tokens = np.concatenate(self.buf)
        name = f"{self.split}_{len(self.shards):06d}.bin"
        write_shard(self.out_dir / name, tokens)
        self.shards.append(ShardInfo(name, int(tokens.size), self.docs, self.bytes))
        self.buf, self.buf_tokens, self.docs, self.bytes = [], 0, 0, 0


def build_dataset(
    documents: Callable[[], Iterable[str]],
    out_dir: Path,
    tokenizer: Tokenizer,
    val_fraction: float = 0.02,
    shard_tokens: int = 50_000_000,
    sources: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> Manifest:
    """Tokenize `documents()` into shards; each document is followed by the boundary token."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out_dir)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    writers = {s: _ShardWriter(out_dir, s, shard_tokens, dtype) for s in ("train", "val")}
    start, index, total = time.time(), 0, 0
    for batch in iter_batches(documents(), 256):
        for text, ids in zip(batch, tokenizer.encode_batch(batch), strict=True):
            split = "val" if is_val_document(index, val_fraction) else "train"
            writers[split].add([*ids, tokenizer.eot_id], len(text.encode("utf-8")))
            index += 1
            total += len(ids) + 1
    for w in writers.values():
        w.flush()
    manifest = Manifest(
        tokenizer={
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "sha256": tokenizer.sha256(),
        },
        dtype=dtype.name,
        shard_tokens=shard_tokens,
        train=writers["train"].shards,
        val=writers["val"].shards,
        sources=sources or [],
    )
    manifest.save(out_dir)
    log(f"prepared {index} documents, {total} tokens in {time.time() - start:.1f}s -> {out_dir}")
    return manifest
