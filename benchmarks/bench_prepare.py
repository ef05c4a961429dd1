"""`pretrain prepare`: tokenizer throughput per core and peak memory as the input grows.

1. Tokens/s per core of the prepare pipeline (parquet in, shards out) against raw `tokenizers`
   `encode_batch` over the same documents with the same tokenizer settings, each on one core
   (TOKENIZERS_PARALLELISM=false), in one child process per round in rotating order, best of each; then
   `--workers N` on all N cores against raw encode_batch in N concurrent single-core processes over
   disjoint row groups (the same cores, the same load). Goal: >= 90% per core.
2. Peak RSS (VmHWM) of a prepare run's main process and largest worker process on a 1/4-size and a
   full-size input (default 200 MB of text; PRETRAIN_BENCH_MB=40 for a quick run). Goal: flat as the
   input grows.
3. A sharded prepare (`--shard-count N`, app/data/shares.py): tokens/s of 1 share (one process, one core)
   and of 2 shares (two processes at once, one core each, then the finalizer), wall clock from the first
   start to the joined data dir (counting pass, start-up and finalizer included), on the input's size up
   to 40 MB, best of ROUNDS - 1 rounds; the scaling ratio 2 shares / 1 share (ideal: 2.0 on 2 idle cores)
   and the finalizer's own seconds (a fixed cost: process start-up, checks, the manifest), beside the
   scaling of raw encode_batch from 1 to N processes measured above in the same run (what the shared
   cores gave). The joined result is checked to be the one-process token stream.

The text is the embedded Shakespeare corpus, repeated with a per-copy prefix to reach the size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3

_PAIR = r"""
import json, os, sys, time
from pathlib import Path
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # both on one core
import pyarrow.parquet as pq
from tokenizers import Tokenizer
from app.data.prepare import prepare
from app.config import PrepareConfig
data, tok_dir, out, order = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]

def raw(ids):
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    tok.encode_special_tokens = True  # as the pipeline encodes document text
    n = docs = 0
    spent = 0.0
    for f in sorted(os.listdir(data)):  # streamed like the pipeline; only the encode calls are timed
        for rb in pq.ParquetFile(os.path.join(data, f)).iter_batches(batch_size=1024, columns=["text"]):
            texts = [t for t in rb.column(0).to_pylist() if t]
            docs += len(texts)
            for i in range(0, len(texts), 128):
                t0 = time.perf_counter()
                enc = tok.encode_batch(texts[i : i + 128], add_special_tokens=False)
                n += sum(len(e.ids) for e in enc) if ids else sum(len(e) for e in enc)
                spent += time.perf_counter() - t0
    return (n + docs) / spent

def pipeline():
    cfg = PrepareConfig([data], Path(out), tokenizer=tok_dir, workers=1, val_fraction=0.01, progress="none")
    t0 = time.perf_counter()
    r = prepare(cfg, log=lambda s: None)
    return r.new_tokens / (time.perf_counter() - t0)

res = {}
for name in order.split(","):
    res[name] = {"raw": lambda: raw(False), "ids": lambda: raw(True), "prepare": pipeline}[name]()
print(json.dumps(res))
"""

_RAW_PART = r"""
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import pyarrow.parquet as pq
from tokenizers import Tokenizer
data, tok_dir, part, parts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
tok.encode_special_tokens = True
n = docs = k = 0
spent = 0.0
for f in sorted(os.listdir(data)):  # row groups part, part + parts, ... of every file
    pf = pq.ParquetFile(os.path.join(data, f))
    mine = [g for g in range(pf.num_row_groups) if (k + g) % parts == part]
    k += pf.num_row_groups
    for rb in pf.iter_batches(batch_size=1024, columns=["text"], row_groups=mine) if mine else []:
        texts = [t for t in rb.column(0).to_pylist() if t]
        docs += len(texts)
        for i in range(0, len(texts), 128):
            t0 = time.perf_counter()
            n += sum(len(e) for e in tok.encode_batch(texts[i : i + 128], add_special_tokens=False))
            spent += time.perf_counter() - t0
print(json.dumps({"tokens": n + docs, "seconds": spent}))
"""

_PIPELINE = r"""
import glob, json, resource, sys, threading, time
from pathlib import Path
from app.data.prepare import prepare
from app.config import PrepareConfig
data, tok_dir, out, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def hwm_mb(pid="self"):
    # VmHWM starts afresh at exec; ru_maxrss would also count the parent's peak (it survives fork+exec).
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return 0.0

workers_hwm = {}
def watch():
    while True:
        for path in glob.glob("/proc/self/task/*/children"):
            for pid in open(path).read().split():
                workers_hwm[pid] = max(workers_hwm.get(pid, 0.0), hwm_mb(pid))
        time.sleep(0.2)
threading.Thread(target=watch, daemon=True).start()

def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
cfg = PrepareConfig([data], Path(out), tokenizer=tok_dir, workers=workers, val_fraction=0.01, progress="none")
t0, c0 = time.perf_counter(), cpu()
r = prepare(cfg, log=lambda s: None)
dt = time.perf_counter() - t0
print(json.dumps({"tokens": r.new_tokens, "seconds": dt, "cpu_seconds": cpu() - c0, "rss_main_mb": hwm_mb(),
                  "rss_workers_mb": max(workers_hwm.values(), default=0.0)}))
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


def _raw_on_cores(data: Path, tok_dir: Path, cores: int) -> tuple[int, float]:
    """Raw encode_batch in `cores` concurrent single-core processes over disjoint row groups:
    (tokens, aggregate tokens/s)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RAW_PART, str(data), str(tok_dir), str(i), str(cores)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(cores)
    ]
    results = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"benchmark child failed: {err.strip()[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    # Conservative: all tokens over the slowest process's encode time (a process that finishes early
    # or is reading leaves its core to the others, which a sum of per-process rates would count twice).
    return sum(r["tokens"] for r in results), sum(r["tokens"] for r in results) / max(
        r["seconds"] for r in results
    )


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


def _prepare_cmd(data: Path, tok_dir: Path, out: Path, *extra: str) -> list[str]:
    flags = ["--tokenizer", str(tok_dir), "--workers", "1", "--val-fraction", "0.01", "--progress", "none"]
    return [sys.executable, "-m", "app.data.cli", "--input", str(data), "--out", str(out), *flags, *extra]


def _shares_rate(data: Path, tok_dir: Path, out: Path, count: int) -> tuple[float, float]:
    """(tokens/s, the finalizer's seconds) of `count` one-core shares at once and the finalizer (count 1:
    one process, no finalizer)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    if count == 1:
        subprocess.run(_prepare_cmd(data, tok_dir, out), cwd=ROOT, env=env, check=True, capture_output=True)
    else:
        share = ["--shard-count", str(count)]
        procs = [
            subprocess.Popen(
                _prepare_cmd(data, tok_dir, out, *share, "--shard-index", str(i)),
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(count)
        ]
        for p in procs:
            _, err = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"benchmark share failed: {err.strip()[-2000:]}")
        t1 = time.perf_counter()
        finalize = _prepare_cmd(data, tok_dir, out, *share, "--finalize")
        subprocess.run(finalize, cwd=ROOT, env=env, check=True, capture_output=True)
    end = time.perf_counter()
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(s["tokens"] for split in ("train", "val") for s in manifest[split])
    return tokens / (end - t0), (end - t1) if count > 1 else 0.0


def _stream(out: Path) -> bytes:
    from app.data.manifest import Manifest
    from app.data.shards import open_shard

    m = Manifest.load(out)
    return b"".join(bytes(open_shard(out / s.file)) for split in ("train", "val") for s in m.split(split))


def _k(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"


def run() -> list[str]:
    from app.data.settings import default_workers

    full_mb = float(os.environ.get("PRETRAIN_BENCH_MB", "200"))
    small_mb = min(20.0, full_mb / 4)
    cores = default_workers()
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    lines: list[str] = []
    try:
        tok_dir = _tokenizer(tmp / "tok")
        _make_input(tmp / "small", small_mb)

        # 1. One core: raw encode_batch, encode_batch + ids, and the pipeline, in one process per round.
        base, base_ids, pipe = [], [], []
        orders = ["raw,prepare,ids", "prepare,ids,raw", "ids,raw,prepare"]
        for r in range(ROUNDS):
            res = _child(_PAIR, tmp / "small", tok_dir, tmp / f"out-w1-{r}", orders[r % len(orders)])
            base.append(res["raw"])
            base_ids.append(res["ids"])
            pipe.append(res["prepare"])
        b1, bi, p1 = max(base), max(base_ids), max(pipe)
        lines.append(
            f"1 core, {small_mb:.0f} MB of text, BPE vocab 8192: raw encode_batch {_k(b1)} tok/s, encode_batch + "
            f".ids {_k(bi)} tok/s, prepare --workers 1 {_k(p1)} tok/s = {100 * p1 / b1:.1f}% of raw (goal >= 90%)"
        )

        # 2. All cores on a quarter-size input (also the first memory figure), then the full size.
        quarter_text = _make_input(tmp / "quarter", full_mb / 4)
        raw_n, pipe_n, quarter = [], [], []
        for r in range(ROUNDS - 1):
            tokens, rate = _raw_on_cores(tmp / "quarter", tok_dir, cores)
            raw_n.append(rate)
            res = _child(_PIPELINE, tmp / "quarter", tok_dir, tmp / f"out-q-{r}", cores)
            assert res["tokens"] == tokens, (res["tokens"], tokens)
            pipe_n.append(res["tokens"] / res["seconds"])
            quarter.append(res)
            shutil.rmtree(tmp / f"out-q-{r}")
        bn, pn = max(raw_n), max(pipe_n)
        lines.append(
            f"{cores} cores, {quarter_text / 1e6:.0f} MB: raw encode_batch in {cores} processes {_k(bn)} tok/s "
            f"({_k(bn / cores)}/core), prepare --workers {cores} {_k(pn)} tok/s ({_k(pn / cores)}/core, including "
            f"reading, writing and worker start-up) = {100 * pn / bn:.1f}% (goal >= 90%)"
        )
        shutil.rmtree(tmp / "quarter")
        full_text = _make_input(tmp / "full", full_mb)
        f = _child(_PIPELINE, tmp / "full", tok_dir, tmp / "out-full", cores)
        q_main = max(q["rss_main_mb"] for q in quarter)
        q_work = max(q["rss_workers_mb"] for q in quarter)
        lines.append(
            f"peak RSS: {quarter_text / 1e6:.0f} MB input: main {q_main:.0f} MB, largest worker {q_work:.0f} MB; "
            f"{full_text / 1e6:.0f} MB input: main {f['rss_main_mb']:.0f} MB, largest worker "
            f"{f['rss_workers_mb']:.0f} MB; ratio for {full_text / quarter_text:.1f}x the input: main "
            f"{f['rss_main_mb'] / q_main:.2f}x, worker {f['rss_workers_mb'] / q_work:.2f}x (goal: flat); "
            f"{_k(f['tokens'] / f['seconds'])} tok/s"
        )

        # 3. Shares: one core per share, at once.
        shares_text = _make_input(tmp / "shares-in", min(40.0, full_mb))
        rates: dict[int, list[float]] = {1: [], 2: []}
        finalizer = []
        for r in range(ROUNDS - 1):
            for count in (1, 2) if r % 2 == 0 else (2, 1):  # alternate which runs first
                rate, fin = _shares_rate(tmp / "shares-in", tok_dir, tmp / f"shares-{count}-{r}", count)
                rates[count].append(rate)
                finalizer += [fin] if count > 1 else []
        assert _stream(tmp / "shares-1-0") == _stream(tmp / "shares-2-0"), "2 shares != 1 process"
        one, two = max(rates[1]), max(rates[2])
        spread = ", ".join(f"{n} share(s) {'/'.join(_k(x) for x in rates[n])}" for n in (1, 2))
        lines.append(
            f"shares, {shares_text / 1e6:.0f} MB, one core each: 1 share {_k(one)} tok/s, 2 shares at once + finalizer "
            f"{_k(two)} tok/s: scaling {two / one:.2f}x on {cores} cores (ideal 2.00 on 2 idle cores; rounds: {spread}; "
            f"the finalizer {min(finalizer):.1f} s of it; this run's raw encode_batch went {bn / b1:.2f}x from 1 to "
            f"{cores} processes: what the cores gave); "
            f"same token stream; load average {os.getloadavg()[0]:.1f} (other processes share these cores)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lines


if __name__ == "__main__":
    for line in run():
        print(line)
