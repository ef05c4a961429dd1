"""The token shard format: round trips, truncation and partial files never pass as complete shards."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from app.data.shards import (
    HEADER_BYTES,
    ShardWriter,
    dtype_for_vocab,
    open_shard,
    payload_sha256,
    read_header,
    remove_stale,
    verify_shard,
)
from app.errors import UserError


def write_shard(path: Path, tokens: np.ndarray) -> None:
    w = ShardWriter(path, tokens.dtype)
    w.write(tokens)
    w.finish()


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_round_trip(tmp_path: Path, dtype) -> None:
    tokens = np.arange(0, 70_000, 7).astype(dtype) if dtype == np.uint32 else np.arange(1000, dtype=dtype)
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens)
    assert path.stat().st_size == HEADER_BYTES + tokens.nbytes
    assert read_header(path) == (np.dtype(dtype), tokens.size)
    assert np.array_equal(open_shard(path), tokens)
    raw = path.read_bytes()
    assert (
        raw[:8] == b"PRETRAIN"
        and raw[HEADER_BYTES:] == tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    )


def test_empty_shard(tmp_path: Path) -> None:
    write_shard(tmp_path / "e.bin", np.zeros(0, np.uint16))
    assert open_shard(tmp_path / "e.bin").size == 0


def test_dtype_for_vocab_boundary() -> None:
    assert dtype_for_vocab(65536) == np.uint16  # ids 0..65535
    assert dtype_for_vocab(65537) == np.uint32


def test_truncated_and_foreign_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_shard(path, np.arange(100, dtype=np.uint16))
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + 150)
    with pytest.raises(UserError, match="truncated: header says 100 tokens, file has 75"):
        read_header(path)
    (tmp_path / "x.bin").write_bytes(b"x" * 300)
    with pytest.raises(UserError, match="bad magic"):
        read_header(tmp_path / "x.bin")
    (tmp_path / "short.bin").write_bytes(b"PRE")
    with pytest.raises(UserError, match="no header"):
        read_header(tmp_path / "short.bin")


def test_streaming_writer_is_atomic_and_hashes_payload(tmp_path: Path) -> None:
    final = tmp_path / "train_000003.bin"
    w = ShardWriter(final, np.uint16)
    w.write(np.arange(10, dtype=np.uint16))
    w.write(np.arange(10, 25, dtype=np.int64))  # converted to the shard's dtype
    assert not final.exists()
    assert w.tmp.name == ".train_000003.bin.partial"
    with pytest.raises(UserError):  # an unfinished shard never reads as complete
        read_header(w.tmp)
    count, sha = w.finish()
    assert count == 25 and not w.tmp.exists()
    expected = np.concatenate([np.arange(10), np.arange(10, 25)]).astype("<u2")
    assert np.array_equal(open_shard(final), expected)
    assert sha == hashlib.sha256(expected.tobytes()).hexdigest() == payload_sha256(final)
    assert verify_shard(final, np.dtype(np.uint16), 25, sha) == ""
    assert "expected 26" in verify_shard(final, np.dtype(np.uint16), 26, sha)
    assert "uint32" in verify_shard(final, np.dtype(np.uint32), 25)
    assert "sha256" in verify_shard(final, np.dtype(np.uint16), 25, "0" * 64)
    assert "cannot read" in verify_shard(tmp_path / "missing.bin", np.dtype(np.uint16), 25)


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path / "val_000000.bin", np.uint32)
    w.write(np.arange(5))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_remove_stale_only_touches_shard_names(tmp_path: Path) -> None:
    names = [
        "train_000000.bin",
        "train_000001.bin",
        "val_000000.bin",
        ".train_000002.bin.partial",
        ".val_000001.bin.tmp-123",
        "notes.bin",
        "train_1.bin",
        "manifest.json",
        "tokenizer.json",
    ]
    for n in names:
        (tmp_path / n).write_text("x")
    removed = remove_stale(tmp_path, keep={"train_000000.bin"})
    assert sorted(removed) == sorted(
        ["train_000001.bin", "val_000000.bin", ".train_000002.bin.partial", ".val_000001.bin.tmp-123"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["train_000000.bin", "notes.bin", "train_1.bin", "manifest.json", "tokenizer.json"]
    )
