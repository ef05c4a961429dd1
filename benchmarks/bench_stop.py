"""The stop agreement every k steps (app/trainer/stopping/agreement.py) on 2 gloo ranks of the tiny preset:

- SIGTERM-to-exit latency (finish the step, agree, checkpoint, exit 143) with k = 1, k = auto and k = 8,
  each against k = 1 measured in the same run: what the preemption grace period must cover;
- throughput of the same runs (tokens/s from metrics.jsonl), against k = 1: what the agreement costs;
- the k that auto took (from the trainer's log line) and the agreement's own cost (`pretrain bench`
  measures the same on the devices of a real job).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPEATS = 2
SETTINGS = {"k=1": "1", "k=auto": "0", "k=8": "8"}


def one_run(workdir: Path, every: str) -> tuple[float, float, str]:
    """(seconds from SIGTERM to exit, median tokens/s, the trainer's line about k or "")."""
    run = workdir / f"k{every}-{time.monotonic_ns()}"
    cmd = [
        sys.executable,
        "-m",
        "app.launch",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "app.train",
        "--out",
        str(run),
        "--max-steps",
        "100000",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.log_every=1",
        "--set",
        "metrics.progress=false",
        "--set",
        f"train.stop_check_every={every}",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    said = ""
    for line in proc.stdout:
        said = line.strip() if "stop agreement: every" in line else said
        if line.startswith("step 30/"):
            break
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)  # the kubelet's signal to the container's PID 1, the launcher
    rest = proc.stdout.read()
    proc.wait()
    latency = time.perf_counter() - start
    if proc.returncode != 143:
        raise RuntimeError(f"k={every}: exit {proc.returncode}: {rest[-2000:]}")
    said = next((ln.strip() for ln in rest.splitlines() if "stop agreement: every" in ln), said)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    tps = [r["tokens_per_second"] for r in rows if r.get("kind") == "train" and r["step"] > 5]
    return latency, statistics.median(tps), said


def run() -> list[str]:
    results: dict[str, list[tuple[float, float, str]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(REPEATS):  # interleaved, so load changes hit every setting alike
            for name, every in SETTINGS.items():
                results[name].append(one_run(Path(tmp), every))
    base_latency = statistics.median(r[0] for r in results["k=1"])
    base_tps = statistics.median(r[1] for r in results["k=1"])
    lines = []
    for name, rows in results.items():
        latency, tps = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        lines.append(
            f"{name:7s} SIGTERM->exit {latency:.2f} s ({latency / base_latency:.2f}x k=1), "
            f"{tps:,.0f} tokens/s ({tps / base_tps:.2f}x k=1)"
        )
    said = next((r[2] for r in results["k=auto"] if r[2]), "")
    lines.append(f"auto: {said or 'k stayed 1 (the agreement is under 1% of a step here)'}")
    return lines


if __name__ == "__main__":
    print("\n".join(run()))
