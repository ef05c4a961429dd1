"""`pretrain serve` on the tiny preset: requests/s, p50/p95 latency and tokens/s at 1, 8 and 32 concurrent
clients, batched (--max-batch 32) against one at a time (--max-batch 1) in the same run, as ratios; one
client's tokens/s through the server against a bare `generate` loop on the same checkpoint (target >=
80%). Also the KV cache's speedup over the uncached loop that `pretrain sample` used.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from app.trainer.model.generate import generate

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 64
# Both sides on one intra-op thread: on a shared 2-core machine more threads only measure contention.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PROMPTS = [
    "ROMEO:\n",
    "JULIET:\n",
    "First Citizen:\n",
    "KING HENRY:\n",
    "HAMLET:\n",
    "NURSE:\n",
    "LEAR:\n",
    "FOOL:\n",
]


def train_tiny(run: Path) -> None:
    """A real tiny-preset checkpoint (a few steps: speed does not depend on how well it is trained)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "train",
            "--out",
            str(run),
            "--max-steps",
            "10",
            "--set",
            "train.eval_every=0",
            "--set",
            "metrics.progress=false",
            "--set",
            "checkpoint.every_minutes=0",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=900,
    )


def bare_tokens_per_second(run: Path) -> tuple[float, float]:
    """(cached, uncached) tokens/s of generate in this process, greedy, MAX_TOKENS per prompt."""
    from app.tools.sample import load_for_inference

    model, tok, _ = load_for_inference(str(run), which="latest", warn=lambda m: None)
    with torch.inference_mode():
        generate(model, torch.tensor([tok.encode(PROMPTS[0])]), 8, temperature=0)  # warm-up
    rates = {}
    for use_cache in (True, False):
        n, start = 0, time.perf_counter()
        for p in PROMPTS if use_cache else PROMPTS[:2]:
            ids = torch.tensor([tok.encode(p)])
            with torch.inference_mode():
                out = generate(model, ids, MAX_TOKENS, temperature=0, use_cache=use_cache)
            n += out.size(1) - ids.size(1)
        rates[use_cache] = n / (time.perf_counter() - start)
    return rates[True], rates[False]


def sample_seconds(run: Path, tokens: int = 200) -> str:
    """What `pretrain sample` pays for its default 200 tokens, with and without the cache."""
    from app.tools.sample import load_for_inference

    model, tok, _ = load_for_inference(str(run), which="latest", warn=lambda m: None)
    ids = torch.tensor([tok.encode("\n")])
    took = {}
    for use_cache in (True, False):
        start = time.perf_counter()
        with torch.inference_mode():
            generate(
                model,
                ids,
                tokens,
                temperature=0.8,
                generator=torch.Generator().manual_seed(0),
                use_cache=use_cache,
            )
        took[use_cache] = time.perf_counter() - start
    return (
        f"{tokens} sampled tokens (pretrain sample's default): {took[True]:.2f} s with the KV cache, "
        f"{took[False]:.2f} s without: {took[False] / took[True]:.1f}x"
    )


def start_server(run: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--checkpoint",
            str(run),
            "--port",
            "0",
            "--model-name",
            "tiny",
            "--max-batch",
            str(max_batch),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **ONE_THREAD},
    )
    lines = []
    while not (m := re.search(r"(http://127\.0\.0\.1:\d+)/v1", lines[-1] if lines else "")):
        lines.append(proc.stdout.readline())
        if not lines[-1] and proc.poll() is not None:
            raise RuntimeError(f"server did not start: {''.join(lines)}")
    url = m.group(1)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server never became healthy")


def complete(url: str, prompt: str) -> tuple[float, int]:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        usage = json.loads(resp.read())["usage"]
    return time.perf_counter() - start, usage["completion_tokens"]


def load(url: str, clients: int, requests: int) -> dict[str, float]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: complete(url, p), prompts))
    wall = time.perf_counter() - start
    lat = sorted(r[0] for r in results)
    return {
        "rps": requests / wall,
        "p50": statistics.median(lat),
        "p95": lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))],
        "tps": sum(r[1] for r in results) / wall,
    }


def run() -> list[str]:
    torch.set_num_threads(1)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "tiny"
        train_tiny(run_dir)
        cached, uncached = bare_tokens_per_second(run_dir)
        out.append(sample_seconds(run_dir))
        out.append(
            f"bare generate (tiny, greedy, {MAX_TOKENS} tokens): {cached:,.0f} tok/s with the KV cache, "
            f"{uncached:,.0f} tok/s without: {cached / uncached:.1f}x"
        )
        servers = {max_batch: start_server(run_dir, max_batch) for max_batch in (1, 32)}
        results: dict[tuple[int, int], dict[str, float]] = {}
        try:
            for _, url in servers.values():
                complete(url, PROMPTS[0])  # warm-up
            # Both modes back to back at each load, best of three rounds: a shared machine's load drifts.
            for clients, requests in ((1, 12), (8, 16), (32, 32)):
                for _ in range(3):
                    for max_batch, (_, url) in servers.items():
                        r = load(url, clients, requests)
                        if r["tps"] > results.get((max_batch, clients), {"tps": 0})["tps"]:
                            results[max_batch, clients] = r
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
        for (max_batch, clients), r in sorted(results.items()):
            mode = "one at a time" if max_batch == 1 else "batched"
            out.append(
                f"serve, {mode:13}, {clients:2} clients: {r['rps']:.1f} req/s, latency p50 {r['p50'] * 1000:.0f} ms, "
                f"p95 {r['p95'] * 1000:.0f} ms, {r['tps']:,.0f} tok/s"
            )
        for clients in (1, 8, 32):
            batched, alone = results[32, clients], results[1, clients]
            out.append(
                f"batching at {clients:2} clients: tokens/s x{batched['tps'] / alone['tps']:.2f}, "
                f"p95 latency x{batched['p95'] / alone['p95']:.2f} (batched / one at a time)"
            )
        ratio = results[1, 1]["tps"] / cached
        out.append(
            f"server generation (1 client, one at a time) vs bare generate: {ratio:.0%} (target >= 80%) "
            f"{'ok' if ratio >= 0.8 else 'BELOW TARGET'}"
        )
    return out
