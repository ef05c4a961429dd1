"""`pretrain prepare`: tokenizer throughput per core and peak memory as the input grows.

1. Tokens/s per core of the prepare pipeline (parquet in, shards out) against raw `tokenizers`
   `encode_batch` over the same documents with the same tokenizer settings, each on one core
   (TOKENIZERS_PARALLELISM=false), alternating rounds in child processes, best of each; then the
   pipeline on every core, also as tokens per CPU-second (robust to other load on a shared machine).
   Goal: >= 90% per core.
2. Peak RSS of a prepare run (main process and worker processes) on a 1/4-size and a full-size input
   (default 200 MB of parquet; PRETRAIN_BENCH_MB=40 for a quick run). Goal: flat as the input grows.

The text is the embedded Shakespeare corpus, repeated with a per-copy prefix to reach the size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3

_BASELINE = r"""
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import pyarrow.parquet as pq
from tokenizers import Tokenizer
data, tok_path, batch, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "ids"
tok = Tokenizer.from_file(tok_path)
tok.encode_special_tokens = True  # as the pipeline encodes document text (measurably faster than the default)
texts = [t for f in sorted(os.listdir(data)) for t in pq.read_table(os.path.join(data, f))["text"].to_pylist()]
t0 = time.perf_counter()
n = 0
for i in range(0, len(texts), batch):
    encodings = tok.encode_batch(texts[i : i + batch], add_special_tokens=False)
    n += sum(len(e.ids) for e in encodings) if ids else sum(len(e) for e in encodings)
print(json.dumps({"tokens": n + len(texts), "seconds": time.perf_counter() - t0}))
"""

_PIPELINE = r"""
import json, resource, sys, time
from pathlib import Path
from app.data.prepare import PrepareConfig, prepare
data, tok_dir, out, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = PrepareConfig([data], Path(out), tokenizer=tok_dir, workers=workers, val_fraction=0.01, progress="none")
def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
t0, c0 = time.perf_counter(), cpu()
r = prepare(cfg, log=lambda s: None)
dt = time.perf_counter() - t0
print(json.dumps({"tokens": r.new_tokens, "seconds": dt, "cpu_seconds": cpu() - c0,
                  "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(f"benchmark child failed: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _make_input(directory: Path, megabytes: float, files: int = 4) -> int:
    """Parquet files holding about `megabytes` of text; returns the text bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data.corpus import documents

    base = list(documents())
    directory.mkdir(parents=True)
    per_file = megabytes * 1e6 / files
    copy, total = 0, 0
    for i in range(files):
        rows: list[str] = []
        size = 0
        while size < per_file:
            for d in base:
                rows.append(f"[copy {copy}]\n{d}")
                size += len(rows[-1])
                if size >= per_file:
                    break
            copy += 1
        pq.write_table(pa.table({"text": rows}), directory / f"part-{i:03d}.parquet", row_group_size=1000)
        total += size
    return total


def _tokenizer(directory: Path) -> Path:
    from app.data.corpus import documents
    from app.data.tokenizer import train_bpe

    directory.mkdir()
    train_bpe(list(documents()), 8192).save(directory)
    return directory


def _k(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"


def run() -> list[str]:
    from app.data.prepare import default_workers

    full_mb = float(os.environ.get("PRETRAIN_BENCH_MB", "200"))
    tput_mb = min(20.0, full_mb / 4)
    cores = default_workers()
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    lines: list[str] = []
    try:
        tok_dir = _tokenizer(tmp / "tok")
        _make_input(tmp / "small", tput_mb)

        # 1. Throughput per core, alternating rounds.
        base, base_ids, pipe = [], [], []
        for r in range(ROUNDS):  # alternate, each in a fresh process (cold caches for all three)
            b = _child(_BASELINE, tmp / "small", tok_dir / "tokenizer.json", 128, "raw")
            base.append(b["tokens"] / b["seconds"])
            p = _child(_PIPELINE, tmp / "small", tok_dir, tmp / f"out-w1-{r}", 1)
            pipe.append(p["tokens"] / p["seconds"])
            assert p["tokens"] == b["tokens"], (p["tokens"], b["tokens"])
            bi = _child(_BASELINE, tmp / "small", tok_dir / "tokenizer.json", 128, "ids")
            base_ids.append(bi["tokens"] / bi["seconds"])
        b1, bi, p1 = max(base), max(base_ids), max(pipe)
        lines.append(
            f"{tput_mb:.0f} MB parquet, BPE vocab 8192, 1 core: raw encode_batch {_k(b1)} tok/s, "
            f"encode_batch + ids {_k(bi)} tok/s, prepare --workers 1 {_k(p1)} tok/s"
        )
        lines.append(
            f"prepare per core vs raw encode_batch: {100 * p1 / b1:.1f}% (goal >= 90%); "
            f"vs encode_batch + ids: {100 * p1 / bi:.1f}%"
        )
        if cores > 1:
            pn = _child(_PIPELINE, tmp / "small", tok_dir, tmp / "out-wn", cores)
            rate, per_cpu = pn["tokens"] / pn["seconds"], pn["tokens"] / pn["cpu_seconds"]
            lines.append(
                f"prepare --workers {cores}: {_k(rate)} tok/s wall ({_k(rate / cores)}/core, shared machine), "
                f"{_k(per_cpu)} tokens per CPU-second incl. main process and worker start-up "
                f"= {100 * per_cpu / b1:.1f}% of raw encode_batch on one core"
            )

        # 2. Peak memory as the input grows.
        rss = {}
        for name, mb in (("quarter", full_mb / 4), ("full", full_mb)):
            text = _make_input(tmp / name, mb)
            r = _child(_PIPELINE, tmp / name, tok_dir, tmp / f"out-{name}", cores)
            rss[name] = (text, r)
            shutil.rmtree(tmp / name)
            shutil.rmtree(tmp / f"out-{name}")
        (qt, q), (ft, f) = rss["quarter"], rss["full"]
        lines.append(
            f"peak RSS, {qt / 1e6:.0f} MB input: main {q['rss_main_mb']:.0f} MB, largest worker "
            f"{q['rss_workers_mb']:.0f} MB; {ft / 1e6:.0f} MB input: main {f['rss_main_mb']:.0f} MB, largest worker "
            f"{f['rss_workers_mb']:.0f} MB"
        )
        lines.append(
            f"peak RSS ratio {ft / qt:.1f}x input: main {f['rss_main_mb'] / q['rss_main_mb']:.2f}x, "
            f"workers {f['rss_workers_mb'] / q['rss_workers_mb']:.2f}x (goal: flat, ~1.0x); "
            f"{_k(f['tokens'] / f['seconds'])} tok/s on {cores} workers"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lines


if __name__ == "__main__":
    for line in run():
        print(line)
