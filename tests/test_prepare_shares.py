"""A sharded prepare (`pretrain prepare --shard-count N --shard-index I`, then `--finalize`) gives a one-process
prepare's token stream and validation split, byte for byte, on real files: in one process share by share, with
a share killed by a real signal and run again, and as two concurrent processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.config import PrepareConfig
from app.data import shares
from app.data.loader import TokenWindows
from app.data.manifest import Manifest
from app.data.prepare import prepare
from app.data.shards import open_shard
from app.data.sources import Fetcher, list_local
from app.data.tokenizer import train_bpe
from tests.procs import Proc

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = Path(sys.executable).with_name("pretrain")  # the console script of this venv
SETTINGS = {"shard_tokens": 2000, "val_fraction": 0.05, "workers": 1, "progress": "none"}


def _docs(seed: int, n: int) -> list[str]:
    """Random documents, one in eight empty (skipped: not a document, yet it must not shift the split)."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(400)] + ["the", "a", "of", "and", "."]
    return [
        "" if rng.random() < 0.125 else " ".join(rng.choice(words, size=int(rng.integers(5, 300))))
        for _ in range(n)
    ]


def make_input(directory: Path, scale: int = 1) -> Path:
    """Parquet files of several row groups (one large, which the shares split), and a jsonl file."""
    directory.mkdir(parents=True)
    pq.write_table(pa.table({"text": _docs(1, 120 * scale)}), directory / "a-big.parquet", row_group_size=8)
    for i in range(3):
        pq.write_table(
            pa.table({"text": _docs(10 + i, 40 * scale)}), directory / f"b-{i}.parquet", row_group_size=10
        )
    lines = [json.dumps({"text": t}) for t in _docs(20, 60 * scale)]
    (directory / "c.jsonl").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("tok")
    train_bpe(_docs(99, 300), 600).save(where)
    return where


def config(inp: Path, out: Path, tokenizer: str, **extra) -> PrepareConfig:
    return PrepareConfig([str(inp)], out, tokenizer=tokenizer, **SETTINGS, **extra)


def streams(data_dir: Path) -> dict[str, bytes]:
    """Each split's token stream: its shards' tokens in manifest order."""
    manifest = Manifest.load(data_dir)
    return {
        split: b"".join(np.asarray(open_shard(data_dir / s.file)).tobytes() for s in manifest.split(split))
        for split in ("train", "val")
    }


def assert_same_data(sharded: Path, one: Path, same_input: bool = True) -> None:
    """The same data; `same_input`: read from the same paths (the manifest lists them)."""
    got, want = streams(sharded), streams(one)
    assert len(got["train"]) > 10_000 and len(got["val"]) > 500
    assert got == want
    a, b = Manifest.load(sharded), Manifest.load(one)
    for field in (
        "tokenizer",
        "dtype",
        "documents",
        "settings",
        "val_fraction",
        *(("sources",) if same_input else ()),
    ):
        assert getattr(a, field) == getattr(b, field), field
    for split in ("train", "val"):
        assert sum(s.documents for s in a.split(split)) == sum(s.documents for s in b.split(split))
        assert sum(s.bytes for s in a.split(split)) == sum(s.bytes for s in b.split(split))
    assert (sharded / "tokenizer.json").read_bytes() == (one / "tokenizer.json").read_bytes()


def test_three_sharersand_the_finalizer_equal_one_process(tmp_path, tokenizer, monkeypatch):
    """Shares run in any order: share 2 first finds no counts of shares 0 and 1 and, past its patience,
    counts them itself; the joined data dir is the one-process one, and the trainer's loader reads it."""
    inp = make_input(tmp_path / "in")
    prepare(config(inp, tmp_path / "one", str(tokenizer)), log=lambda s: None)
    monkeypatch.setattr(shares, "PEER_PATIENCE", 0.0)
    lines: list[str] = []
    for index in (2, 0, 1):
        shares.run(
            config(inp, tmp_path / "sharded", str(tokenizer), shard_count=3, shard_index=index),
            log=lines.append,
        )
    assert any("counting it here" in line for line in lines)
    shares.run(
        config(inp, tmp_path / "sharded", str(tokenizer), shard_count=3, finalize=True), log=lines.append
    )
    assert_same_data(tmp_path / "sharded", tmp_path / "one")
    manifest = Manifest.load(tmp_path / "sharded")
    assert {s.file.split("/")[2] for s in manifest.train} == {"0", "1", "2"}  # every share contributed
    windows = TokenWindows(tmp_path / "sharded", "train", 64)
    assert windows.count > 100 and windows.window(windows.count - 1).size == 65
    # a re-run of a finished share changes nothing; the finalizer again gives the same
    shares.run(
        config(inp, tmp_path / "sharded", str(tokenizer), shard_count=3, shard_index=1), log=lines.append
    )
    assert "is up to date" in lines[-3]
    shares.run(
        config(inp, tmp_path / "sharded", str(tokenizer), shard_count=3, finalize=True), log=lambda s: None
    )
    assert_same_data(tmp_path / "sharded", tmp_path / "one")


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 40])
def test_the_sharerscut_the_input_once_in_order(tmp_path, count):
    """Every row group of every parquet file and every other file belongs to exactly one share, and the
    shares, in order, read the input in its order; more shares than parts leaves some empty."""
    inp = make_input(tmp_path / "in")
    files = list_local(str(inp))
    fetcher = Fetcher(files, lambda f: Path(f.local_path))
    units = []
    for index in range(count):
        for part in shares.share_parts(files, fetcher, index, count):
            n = pq.ParquetFile(part.local_path).num_row_groups if part.format == "parquet" else 1
            first, stop = part.row_groups or (0, n)
            units += [(part.name, g) for g in range(first, stop)]
    expected = [
        (f.name, g)
        for f in files
        for g in range(pq.ParquetFile(f.local_path).num_row_groups if f.format == "parquet" else 1)
    ]
    assert units == expected


def _share_cmd(inp: Path, out: Path, tokenizer: str, count: int, *extra: str) -> list[str]:
    flags = ["--shard-tokens", "2000", "--val-fraction", "0.05", "--workers", "1", "--progress", "log"]
    return [
        str(PRETRAIN),
        "prepare",
        "--input",
        str(inp),
        "--out",
        str(out),
        "--tokenizer",
        tokenizer,
        *flags,
        "--shard-count",
        str(count),
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "JOB_COMPLETION_INDEX"}, "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_share_killed_midway_resumes_and_gives_the_same_result(tmp_path, tokenizer):
    """SIGKILL to share 1 after it wrote some shards; the re-run keeps them, tokenizes the rest, and the
    joined result equals a one-process prepare."""
    inp = make_input(tmp_path / "in", scale=6)
    prepare(config(inp, tmp_path / "one", str(tokenizer)), log=lambda s: None)
    out = tmp_path / "sharded"
    shares.run(config(inp, out, str(tokenizer), shard_count=3, shard_index=0), log=lambda s: None)
    share1 = shares.share_dir(out, 1, 3)
    cmd = _share_cmd(inp, out, str(tokenizer), 3, "--shard-index", "1")
    proc = Proc(cmd, tmp_path / "share1.log", env=_env(), cwd=ROOT, separate_stderr=True)
    proc.wait_until(lambda: len(list(share1.glob("train_*.bin"))) >= 3, "3 shards of share 1", 60, 0.05)
    assert proc.poll() is None, f"share 1 ended before it could be killed: {proc.errors}"
    proc.kill()
    proc.wait(timeout=30)
    kept = len(list(share1.glob("*.bin")))  # train and val shards
    assert not (share1 / "manifest.json").exists()
    again = _run(_share_cmd(inp, out, str(tokenizer), 3, "--shard-index", "1"))
    assert again.returncode == 0, again.stderr
    # the shards recorded before the kill are kept (one renamed but not yet recorded is made again)
    resumed = re.search(r"resuming: (\d+) shards already written and verified", again.stdout)
    assert resumed and 1 <= int(resumed.group(1)) <= kept, again.stdout
    shares.run(config(inp, out, str(tokenizer), shard_count=3, shard_index=2), log=lambda s: None)
    done = _run(_share_cmd(inp, out, str(tokenizer), 3, "--finalize"))
    assert done.returncode == 0, done.stderr
    assert_same_data(out, tmp_path / "one")


@pytest.mark.slow
def test_two_processes_at_once_and_the_finalizer_equal_one_process(tmp_path):
    """Two `pretrain prepare --shard-count 2` processes at once (the second from $JOB_COMPLETION_INDEX, as an
    Indexed Job's pod), with a BPE tokenizer to train: share 0 trains it on the whole input's first documents,
    share 1 waits for it. The finalizer's result equals a one-process prepare, tokenizer included."""
    inp = make_input(tmp_path / "in")
    prepare(
        config(inp, tmp_path / "one", "bpe", vocab_size=500, sample_bytes=256 * 10**6), log=lambda s: None
    )
    out = tmp_path / "sharded"
    sharers = [
        Proc(
            _share_cmd(
                inp, out, "bpe", 2, "--vocab-size", "500", *(["--shard-index", "0"] if i == 0 else [])
            ),
            tmp_path / "logs" / f"share{i}.log",
            env={**_env(), **({"JOB_COMPLETION_INDEX": "1"} if i == 1 else {})},
            cwd=ROOT,
            separate_stderr=True,
        )
        for i in range(2)
    ]
    codes = [p.wait(240) for p in sharers]
    assert codes == [0, 0], [p.errors for p in sharers]
    assert "training a byte-level BPE" in sharers[0].output and "training" not in sharers[1].output
    done = _run(_share_cmd(inp, out, "bpe", 2, "--vocab-size", "500", "--finalize"))
    assert done.returncode == 0, done.stderr
    assert_same_data(out, tmp_path / "one")


def test_unfinished_or_stale_sharersare_refused_in_one_line(tmp_path, tokenizer):
    inp = make_input(tmp_path / "in")
    out = tmp_path / "sharded"
    shares.run(config(inp, out, str(tokenizer), shard_count=3, shard_index=0), log=lambda s: None)

    def run(*extra: str) -> subprocess.CompletedProcess:
        return _run(_share_cmd(inp, out, str(tokenizer), 3, *extra))

    proc = run("--finalize")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "share 1 of 3 not started; share 2 of 3 not started" in proc.stderr
    proc = run()  # no --shard-index, no $JOB_COMPLETION_INDEX
    assert proc.returncode == 2 and "--shard-count 3 needs --shard-index I (0..2)" in proc.stderr
    proc = run("--shard-index", "3")
    assert proc.returncode == 2 and "--shard-index must be in 0..2" in proc.stderr
    cmd = _share_cmd(inp, out, str(tokenizer), 3)
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**_env(), "JOB_COMPLETION_INDEX": "5"}, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--shard-index" not in proc.stderr, proc.stderr  # not given: not named
    assert "$JOB_COMPLETION_INDEX is 5, not a share of --shard-count 3 (0..2)" in proc.stderr
    # a given tokenizer that is not there is refused before the share's counting pass reads its input
    proc = run("--shard-index", "1", "--tokenizer", str(tmp_path / "nope.json"))
    assert proc.returncode == 2 and "nope.json" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (out / "shares" / "3" / "counts" / "1.json").exists(), "counted before the tokenizer was found"
    proc = run("--finalize", "--shard-index", "1")
    assert proc.returncode == 2 and "leave out --shard-index" in proc.stderr
    # an input changed after share 0 was made: it no longer counts as finished for these inputs
    for index in (1, 2):
        shares.run(config(inp, out, str(tokenizer), shard_count=3, shard_index=index), log=lambda s: None)
    lines = [json.dumps({"text": t}) for t in _docs(21, 5)]
    with open(inp / "c.jsonl", "a") as f:
        f.write("\n".join(lines) + "\n")
    proc = run("--finalize")
    assert proc.returncode == 2 and "share 0 of 3 made for other inputs or settings" in proc.stderr
    # other settings in the same shares dir are refused, not mixed
    proc = run("--shard-index", "0", "--val-fraction", "0.1")
    assert (
        proc.returncode == 2
        and "holds shares prepared with other settings (val_fraction differ)" in proc.stderr
    )
