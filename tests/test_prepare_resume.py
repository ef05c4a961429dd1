"""Kill a real `pretrain prepare` with SIGKILL midway; the re-run finishes and equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app.config import PrepareConfig
from app.data.manifest import MANIFEST, STATE
from app.data.prepare import prepare
from app.data.shards import read_header
from app.data.tokenizer import train_bpe
from tests.procs import Proc, alive, children

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = Path(sys.executable).with_name("pretrain")  # the console script of this venv


def _docs(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(400)] + ["the", "a", "of", "and", "."]
    return [" ".join(rng.choice(words, size=int(rng.integers(20, 400)))) for _ in range(n)]


def test_sigkill_midway_then_rerun_equals_uninterrupted(tmp_path: Path) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    for i in range(12):
        pq.write_table(pa.table({"text": _docs(i, 80)}), inp / f"part-{i:02d}.parquet", row_group_size=10)
    tok = train_bpe(_docs(99, 200), 600)
    (tmp_path / "tok").mkdir()
    tok.save(tmp_path / "tok")
    opts = ["--tokenizer", str(tmp_path / "tok"), "--shard-tokens", "5000", "--val-fraction", "0.03"]

    ref = tmp_path / "ref"
    prepare(
        PrepareConfig(
            [str(inp)],
            ref,
            tokenizer=str(tmp_path / "tok"),
            shard_tokens=5000,
            val_fraction=0.03,
            workers=1,
            progress="none",
        )
    )
    n_ref = len(list(ref.glob("train_*.bin")))
    assert n_ref >= 50

    out = tmp_path / "out"
    cmd = [str(PRETRAIN), "prepare", "--input", str(inp), "--out", str(out), *opts]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = Proc([*cmd, "--workers", "2"], tmp_path / "prepare.log", env=env, cwd=ROOT, separate_stderr=True)
    proc.wait_until(lambda: len(list(out.glob("train_*.bin"))) >= 6, "6 shards written")
    workers = children(proc.pid)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    # The tokenizer workers die with it instead of lingering.
    deadline = time.time() + 10
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers)

    # Killed midway: no manifest, and every file that looks like a shard is a complete one.
    assert not (out / MANIFEST).exists()
    written = sorted(out.glob("train_*.bin"))
    assert 6 <= len(written) < n_ref
    for shard in written:
        read_header(shard)
    recorded = [s["file"] for s in json.loads((out / STATE).read_text())["train"]]
    assert len(recorded) >= 5

    r = subprocess.run([*cmd, "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == {
        p.name: p.read_bytes() for p in ref.glob("*.bin")
    }
    assert (out / MANIFEST).read_text() == (ref / MANIFEST).read_text()
    assert not list(out.glob(".*.partial"))
