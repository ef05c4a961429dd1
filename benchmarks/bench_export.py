"""`pretrain export --format hf` on GPT-2-small-sized weights (the gpt2-124m preset: 124M parameters, a
50,257-token vocabulary padded to 50,304 rows, ~0.5 GB in fp32) on CPU, against a baseline measured in the
same run: the report export's consolidation of the same checkpoint (`final.safetensors`, write_final).

Each export runs in a fresh process (`python -m benchmarks.bench_export --worker ...`), which reports
its wall time and its peak RSS above its level before the export (VmHWM, reset through
/proc/self/clear_refs, the way benchmarks/checkpoint_worker.py measures saves). Figures:

- time of the hf export (fp32; bf16; fp32 in 100 MB shards) / the consolidation's
- peak RSS above the start of each, against the largest tensor: both stream one tensor at a time, so
  the target is about one tensor (plus its bf16 copy), never the model
- the whole command as a user runs it (`pretrain export --format hf`, imports included), in seconds

BENCH_EXPORT_REPEATS=N (default 2): best of N, methods interleaved.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPEATS = int(os.environ.get("BENCH_EXPORT_REPEATS", "2"))
MB = 1e6


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def worker(method: str, run_dir: str, out: str) -> dict:
    """One export in this (fresh) process: its seconds and peak RSS above the level before it."""
    from app.tools.export import export_hf, write_final
    from app.trainer.checkpoint import store as ckpt

    exports = {
        "consolidate": lambda: write_final(
            Path(out) / "final.safetensors", ckpt.resolve_latest(Path(run_dir))
        ),
        "hf": lambda: export_hf(Path(run_dir), Path(out)),
        "hf-bf16": lambda: export_hf(Path(run_dir), Path(out), dtype="bfloat16"),
        "hf-shards": lambda: export_hf(Path(run_dir), Path(out), max_shard_size=100 * 10**6),
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    exports[method]()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak": _status_kb("VmHWM") * 1024 - before}


def make_run(root: Path) -> tuple[Path, int, int]:
    """A run dir with one checkpoint of the gpt2-124m preset's model (random weights), a small BPE
    tokenizer (the export copies it; its size does not matter here): (run dir, parameters, largest tensor
    in bytes)."""
    import torch

    from app.config import load_config
    from app.data.corpus import documents
    from app.data.tokenizer import train_bpe
    from app.trainer.checkpoint.writer import CheckpointWriter
    from app.trainer.model.gpt import build_model

    cfg = load_config("gpt2-124m")
    run = root / "run"
    run.mkdir()
    tok = train_bpe(itertools.islice(documents(), 20), 512)
    tok.save(root)
    (run / "metrics.jsonl").write_text("")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    meta = {"config": cfg.to_dict(), "tokens": 0}
    CheckpointWriter(run, 0, 1).save(1, model, None, {"step": 1}, meta, extra_files=[root / "tokenizer.json"])
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return run, sum(p.numel() for p in model.parameters()), largest


def in_fresh_process(method: str, run: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "benchmarks.bench_export", "--worker", method, str(run), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"export worker {method} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def run() -> list[str]:
    methods = ("consolidate", "hf", "hf-bf16", "hf-shards")
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        run_dir, params, largest = make_run(root)
        made = time.perf_counter() - t0
        best: dict[str, dict] = {}
        for i, method in itertools.product(range(REPEATS), methods):
            r = in_fresh_process(method, run_dir, root / f"{method}-{i}")
            best[method] = {k: min(v, best.get(method, r)[k]) for k, v in r.items()}
        env = dict(os.environ, PYTHONPATH=str(REPO))
        t0 = time.perf_counter()
        cli = [
            sys.executable,
            "-m",
            "app.cli",
            "export",
            str(run_dir),
            "--output",
            str(root / "cli"),
            "--format",
            "hf",
        ]
        subprocess.run(cli, cwd=REPO, env=env, check=True, capture_output=True)
        command = time.perf_counter() - t0
    base = best["consolidate"]
    lines = [
        f"gpt2-124m weights: {params / 1e6:.1f}M parameters ({params * 4 / MB:,.0f} MB fp32), largest tensor "
        f"{largest / MB:.0f} MB; checkpoint written in {made:.0f}s; best of {REPEATS}, each in a fresh process",
        f"baseline, the report export's consolidation (final.safetensors): {base['seconds']:.2f}s, "
        f"peak RSS +{base['peak'] / MB:.0f} MB",
    ]
    for method in methods[1:]:
        r = best[method]
        lines.append(
            f"{method}: {r['seconds']:.2f}s = {r['seconds'] / base['seconds']:.2f}x the consolidation; peak RSS "
            f"+{r['peak'] / MB:.0f} MB = {r['peak'] / largest:.2f}x the largest tensor "
            f"({r['peak'] / max(base['peak'], 1):.2f}x the consolidation's)"
        )
    lines.append(f"`pretrain export --format hf` as a command, imports included: {command:.1f}s")
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print("RESULT " + json.dumps(worker(*sys.argv[2:5])))
    else:
        print("\n".join(run()))
    sys.exit(0)
