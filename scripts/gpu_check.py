#!/usr/bin/env python3
"""`make gpu-check`: the first ten minutes on a GPU machine. Measures what no CPU test can and writes it
as JSON, each figure with the range docs/performance.md expects beside it ("make gpu-check"):

- first, scripts/gpu_setup.py's check: no driver, a CPU build of torch, a driver too old for the wheel, no
  C compiler or Python headers for Triton each stop it in one line (exit 2) before any figure;
- the device and the versions (GPU, driver, torch, CUDA, cuDNN, NCCL, torchao, Python);
- the attention kernel SDPA picks for the model's attention, with all heads (MHA) and with grouped
  K/V heads (GQA, x1-50m's 12/4): a fused kernel is expected, the math fallback (T x T matrices) is not;
- the data path: the micro-batch the loop copies is one contiguous pinned block;
- `pretrain bench` of x1-50m and gpt2-124m compiled (the CUDA default), eager, and compiled with FP8, and of
  gpt2-124m-speedrun (ReLU², value embeddings, Muon) compiled and with FP8: tokens/s, MFU, the micro-batch
  auto picked and its peak memory against the estimate (without the CUDA context, which the allocator does
  not count), compile time, recompiles and graph breaks.

Each bench runs in its own process (an out-of-memory error or a crash costs one figure, not the rest) under
one deadline (--minutes, default 9.5) and a cap of its own: twice its share of the time left (the time left
over the benches left), or --bench-seconds. A bench past its cap (a hung compile) is killed with its
process group and reported TIMED OUT; the later ones still run. Figures it has no time for are reported as
not measured.

    make gpu-check                                   # on the GPU machine: runs/gpu-check.json
    python scripts/gpu_check.py --dry-run --out F    # anywhere: the same plumbing at toy sizes on CPU

--dry-run checks the script itself (tests/test_gpu_check.py runs it): toy shapes, one step, FP8 emulated,
no range judged (a CPU reaches none of them). Nothing here is imported by the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("x1-50m", "gpt2-124m")
SPEEDRUN = "gpt2-124m-speedrun"
# Hopper SXM-class GPUs (989 dense bf16 TFLOP/s): the MFU ranges are theirs; other GPUs get the ratios only.
HOPPER = ("h100-sxm", "h200", "h800", "gh200")

# What docs/performance.md expects ("make gpu-check"), as (low, high); text values list what passes.
# MFU: an outside review's estimate for one H100 SXM from the step's structure (no GPU figure yet).
EXPECTED: dict[str, tuple] = {
    "sdpa MHA": ("flash", "cudnn", "efficient"),
    "sdpa GQA": ("flash", "cudnn", "efficient"),
    "data pinned contiguous int32": (True,),
    "x1-50m compiled MFU": (0.33, 0.42),
    "gpt2-124m compiled MFU": (0.36, 0.45),
    f"{SPEEDRUN} compiled MFU": (0.33, 0.39),
    "x1-50m eager / compiled tokens/s": (0.55, 0.90),
    "gpt2-124m eager / compiled tokens/s": (0.55, 0.90),
    "x1-50m fp8 / bf16 tokens/s": (0.80, 1.10),
    "gpt2-124m fp8 / bf16 tokens/s": (0.80, 1.10),
    f"{SPEEDRUN} fp8 / bf16 tokens/s": (0.80, 1.10),
    "x1-50m compiled peak / estimate": (0.85, 1.05),
    "gpt2-124m compiled peak / estimate": (0.85, 1.05),
    f"{SPEEDRUN} compiled peak / estimate": (0.60, 1.00),
    "x1-50m eager peak / estimate": (0.85, 1.05),
    "gpt2-124m eager peak / estimate": (0.85, 1.05),
    "x1-50m micro-batch as planned": (True,),
    "gpt2-124m micro-batch as planned": (True,),
    f"{SPEEDRUN} micro-batch as planned": (True,),
    "recompiles, x1-50m and gpt2-124m": (0, 0),
    # one graph per kind of block, 6 kinds: the first (the x0 skip's input is the embedding itself), with or
    # without a value table, with or without a U-net skip (added inside the block), and the innermost skip,
    # whose source is the block just before (its input and its skip are one tensor); the dry run, at the
    # preset's depth, measures the same
    f"{SPEEDRUN} compiled recompiles": (5, 5),
    "graph breaks": (0, 0),
}
WHY = {
    "sdpa MHA": "a fused kernel; math materialises T x T scores (memory and time)",
    "sdpa GQA": "enable_gqa with a fused kernel, no repeated K/V",
    "data pinned contiguous int32": "the copy does not stage through pageable memory",
    "x1-50m compiled MFU": "H100 SXM-class only; d768 matmuls and a 38% head",
    "gpt2-124m compiled MFU": "H100 SXM-class only; nanochat reports ~41% at this scale",
    f"{SPEEDRUN} compiled MFU": "H100 SXM-class only; the switches' elementwise work runs between matmuls",
    "x1-50m eager / compiled tokens/s": "compile fuses norms, RoPE and the loss",
    "gpt2-124m eager / compiled tokens/s": "as x1-50m",
    "x1-50m fp8 / bf16 tokens/s": "d768 is too narrow for FP8 to pay (docs: FP8)",
    "gpt2-124m fp8 / bf16 tokens/s": "as x1-50m",
    f"{SPEEDRUN} fp8 / bf16 tokens/s": "as x1-50m; w_down (its input is relu(x)^2) stays in bf16",
    "x1-50m compiled peak / estimate": "allocator peak against the estimate less the CUDA context",
    "gpt2-124m compiled peak / estimate": "as x1-50m",
    f"{SPEEDRUN} compiled peak / estimate": "the switches' compiled block terms are eager's (an upper bound)",
    "x1-50m eager peak / estimate": "the eager estimate is exact on CPU",
    "gpt2-124m eager peak / estimate": "as x1-50m",
    "x1-50m micro-batch as planned": "auto at start = `pretrain plan` for this GPU type (same device size)",
    "gpt2-124m micro-batch as planned": "as x1-50m",
    f"{SPEEDRUN} micro-batch as planned": "as x1-50m",
    "recompiles, x1-50m and gpt2-124m": "every bench run: dynamic=False, one static graph per shape",
    f"{SPEEDRUN} compiled recompiles": "by design: one graph per kind of block (the first; with or without a value table, a U-net skip; the innermost skip)",
    "graph breaks": "fullgraph=True makes a break an error",
}
HOPPER_ONLY = {name for name in EXPECTED if name.endswith("MFU")}
# the dry run traces the same graphs without generating kernels (aot_eager): the recompiles and graph
# breaks it counts are dynamo's, the same with either backend, and it checks plumbing, not codegen
KINDS = {
    "compiled": (["train.compile=true"], ["train.compile=true", "train.compile_backend=aot_eager"]),
    "eager": (["train.compile=false"], ["train.compile=false"]),
    "fp8": (["train.compile=true", "train.fp8=true"], ["train.compile=false", "train.fp8=emulate"]),
}
# the bench runs: (label, preset, --set overrides on the GPU, --set overrides in the dry run)
RUNS = [
    (f"{preset} {kind}", preset, *KINDS[kind])
    for preset, kinds in [
        *((p, ("compiled", "eager", "fp8")) for p in PRESETS),
        (SPEEDRUN, ("compiled", "fp8")),
    ]
    for kind in kinds
]
DRY_MODEL = [
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.seq_len=64",
    "model.vocab_size=512",
    "train.batch_tokens=512",
    "train.device=cpu",
]
# the speedrun at its full depth (toy width): the same kinds of blocks, so the same recompiles as on the GPU
DRY_PRESET = {SPEEDRUN: ["model.n_layer=12"]}
MIN_BENCH_SECONDS = 5.0  # less time left than this: not started


def dry_model(preset: str) -> list[str]:
    return [*DRY_MODEL, *DRY_PRESET.get(preset, [])]


def bench_cap(left: float, benches_left: int, fixed: float = 0.0) -> float:
    """A bench's time cap: --bench-seconds, or twice its share of the time left, so that a hung one costs
    two shares and every later bench still gets time; never past the deadline."""
    share = left if benches_left <= 1 else 2 * left / benches_left
    return min(left, fixed or share)


def expected_rows() -> list[str]:
    """The rows of docs/performance.md's table, rendered from EXPECTED (tests/test_gpu_check.py)."""
    return [f"| {name} | {show(EXPECTED[name])} | {WHY[name]} |" for name in EXPECTED]


def show(expected: tuple) -> str:
    if isinstance(expected[0], str | bool):
        return " or ".join(str(v) for v in expected)
    low, high = expected
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def judge(name: str, value, gpu_type: str, dry: bool) -> bool | None:
    """In range (True/False), or None: not judged (a dry run, no value, or a range for another GPU)."""
    if dry or value is None or (name in HOPPER_ONLY and gpu_type not in HOPPER):
        return None
    expected = EXPECTED[name]
    if isinstance(expected[0], str | bool):
        return value in expected
    return expected[0] <= value <= expected[1]


# ---------------------------------------------------------------- what is measured in this process


def device_info(smi: str | None) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": False}
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except ImportError:
        info["torchao"] = None
    if not torch.cuda.is_available():
        return {**info, "device": "cpu"}
    from gpu_setup import parse_smi

    from app.gpus import key_of

    name = torch.cuda.get_device_name(0)
    driver = parse_smi(smi or "")
    return {
        **info,
        "cuda_available": True,
        "device": name,
        "gpu_type": key_of(name),
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_bytes": torch.cuda.mem_get_info(0)[1],
        "driver": driver.version if driver else None,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }


def sdpa_backend(kv_heads: int, dry: bool) -> str:
    """The kernel scaled_dot_product_attention runs for the model's attention (x1-50m's shapes, bf16 on a
    GPU), forward and backward, read from the profiler's op names."""
    import torch
    from torch.profiler import profile

    from app.config import load_config
    from app.trainer.model.gpt import Attention, rope_tables

    m = load_config("x1-50m", overrides=[f"model.n_kv_head={kv_heads}"]).model
    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    batch, seq = (4, m.seq_len) if cuda else (1, 64)
    attention = Attention(m).to(device)
    cos, sin = (t.to(device) for t in rope_tables(seq, m.d_model // m.n_head, m.rope_base))
    x = torch.randn(batch, seq, m.d_model, device=device, requires_grad=True)
    cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    with profile() as prof:
        with cast:
            y = attention(x, cos, sin)
        y.float().sum().backward()
    names = {e.name for e in prof.events()}
    kernels = {
        "aten::_scaled_dot_product_cudnn_attention": "cudnn",
        "aten::_scaled_dot_product_flash_attention": "flash",
        "aten::_scaled_dot_product_efficient_attention": "efficient",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
        "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    }
    return next((kind for op, kind in kernels.items() if op in names), "math")


def data_path(dry: bool) -> bool:
    """The Prefetcher's host micro-batch: contiguous int32, pinned on CUDA (on a CPU: nothing to pin)."""
    import torch

    from app.data.loader import Prefetcher
    from app.tools.bench import SyntheticBatches

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    batches = Prefetcher(SyntheticBatches(50257, 1024, 8, 0, 0), device, depth=2)
    try:
        rows = batches.host_rows(0)
        x, y = batches.next()
        ok = rows.is_contiguous() and rows.dtype == torch.int32 and x.dtype == y.dtype == torch.int64
        return bool(ok and (rows.is_pinned() or not cuda) and x.device.type == device.type)
    finally:
        batches.close()


# ---------------------------------------------------------------- the benches, one process each


def bench(label: str, preset: str, overrides: list[str], dry: bool, seconds: float, work: Path) -> dict:
    """One `pretrain bench` in its own process and process group, killed with its compile workers after
    `seconds`: its JSON, or {"error": why}."""
    out = work / f"{label.replace(' ', '-')}.json"
    steps = ["--steps", "1", "--warmup", "1"] if dry else ["--steps", "8", "--warmup", "2"]
    sets = [a for kv in (*overrides, *(dry_model(preset) if dry else [])) for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "app.tools.bench", "--preset", preset, *steps, "--breakdown-steps", "0"]
    cmd += ["--out", str(out), "--force", *sets]
    out.unlink(missing_ok=True)
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"TIMED OUT after {seconds:.3g} s"}
    if proc.returncode != 0 or not out.exists():
        last = (stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {proc.returncode}: {last[:300]}"}
    return json.loads(out.read_text())


def planned_micro_batch(preset: str, gpu_type: str, dry: bool) -> int | None:
    """What `pretrain plan --gpu TYPE --gpus 1` lays out for the preset (None: no table entry)."""
    from app.config import load_config, vocab_for_estimates
    from app.trainer.parallel import layout
    from app.trainer.parallel.memory import GPU_MEMORY_GB

    cfg = load_config(preset, overrides=[*(dry_model(preset) if dry else []), "train.compile=true"])
    cfg.model.vocab_size = vocab_for_estimates(cfg)
    if dry:  # the CPU's own memory, as the dry run's micro-batch auto sees it
        return layout.auto_micro_batch(cfg, 1, "cpu").micro_batch
    return layout.fit(cfg, gpu_type, 1).micro_batch if gpu_type in GPU_MEMORY_GB else None


def allocator_estimate(run: dict) -> int | None:
    """The estimate of what torch's allocator holds at its peak: the run's estimate less the CUDA context,
    NCCL's buffers and fragmentation (app/trainer/parallel/memory.py CUDA_OVERHEAD), which it never counts."""
    from app.trainer.parallel.memory import CUDA_OVERHEAD

    estimate = run.get("estimated_memory_bytes")
    if not estimate:
        return None
    return estimate - (CUDA_OVERHEAD if run.get("device") == "cuda" else 0)


def figures(runs: dict[str, dict], sdpa: dict, data_ok: bool, gpu_type: str, dry: bool) -> dict:
    """The measured value of every EXPECTED figure (None where its run failed)."""

    def ratio(a, b):
        return a / b if a and b else None

    values = {"sdpa MHA": sdpa["MHA"], "sdpa GQA": sdpa["GQA"], "data pinned contiguous int32": data_ok}
    for p in (*PRESETS, SPEEDRUN):
        compiled, eager, fp8 = (runs.get(f"{p} {k}", {}) for k in ("compiled", "eager", "fp8"))
        values[f"{p} compiled MFU"] = compiled.get("mfu")
        values[f"{p} fp8 / bf16 tokens/s"] = ratio(
            fp8.get("tokens_per_second"), compiled.get("tokens_per_second")
        )
        if p in PRESETS:
            values[f"{p} eager / compiled tokens/s"] = ratio(
                eager.get("tokens_per_second"), compiled.get("tokens_per_second")
            )
        for kind, run in (("compiled", compiled), ("eager", eager)):
            values[f"{p} {kind} peak / estimate"] = ratio(
                run.get("peak_memory_bytes"), allocator_estimate(run)
            )
        chosen = (compiled.get("layout") or {}).get("micro_batch_size")
        planned = planned_micro_batch(p, gpu_type, dry)
        values[f"{p} micro-batch as planned"] = None if not (chosen and planned) else chosen == planned
    measured = {label: r for label, r in runs.items() if "error" not in r}
    plain = [r for label, r in measured.items() if not label.startswith(SPEEDRUN)]
    values["recompiles, x1-50m and gpt2-124m"] = sum(r.get("recompiles", 0) for r in plain) if plain else None
    speedrun = measured.get(f"{SPEEDRUN} compiled")
    values[f"{SPEEDRUN} compiled recompiles"] = speedrun.get("recompiles") if speedrun else None
    values["graph breaks"] = sum(r.get("graph_breaks", 0) for r in measured.values()) if measured else None
    return {name: values.get(name) for name in EXPECTED}


def first_check(dry: bool) -> tuple[str | None, str | None]:
    """scripts/gpu_setup.py's check (what stops the GPU path, one line), and nvidia-smi's output."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_setup import diagnose, read_host, read_smi

    smi = read_smi()
    if dry:
        return None, smi
    return diagnose(read_host(smi)), smi


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "gpu-check.json"), help="the JSON to write")
    parser.add_argument("--minutes", type=float, default=9.5, help="the deadline for every figure together")
    parser.add_argument(
        "--bench-seconds",
        type=float,
        default=0.0,
        help="the time cap of each bench (default: twice its share of the time left)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, toy sizes: checks this script's plumbing"
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    problem, smi = first_check(args.dry_run)
    if problem:
        hint = ", or --dry-run to check the script" if "nvidia-smi not found" in problem else ""
        print(f"gpu-check: {problem}{hint}")
        return 2
    out = Path(args.out)
    work = out.parent / f"{out.stem}.runs"
    work.mkdir(parents=True, exist_ok=True)
    info = device_info(None if args.dry_run else smi)
    sdpa = {"MHA": sdpa_backend(12, args.dry_run), "GQA": sdpa_backend(4, args.dry_run)}
    data_ok = data_path(args.dry_run)
    runs: dict[str, dict] = {}
    for i, (label, preset, gpu, dry) in enumerate(RUNS):
        left = deadline - time.monotonic()
        if label.endswith("fp8") and not args.dry_run and tuple(info.get("capability", (0, 0))) < (8, 9):
            runs[label] = {"error": "not measured: FP8 needs compute capability >= 8.9"}
            continue
        if left < MIN_BENCH_SECONDS:
            runs[label] = {"error": "not measured: out of time"}
            continue
        cap = bench_cap(left, len(RUNS) - i, args.bench_seconds)
        print(f"gpu-check: {label} (at most {cap:.0f} s of {left:.0f} s left)", flush=True)
        runs[label] = bench(label, preset, dry if args.dry_run else gpu, args.dry_run, cap, work)
    gpu_type = info.get("gpu_type", "")
    values = figures(runs, sdpa, data_ok, gpu_type, args.dry_run)
    rows = [
        {
            "name": name,
            "value": values[name],
            "expected": show(EXPECTED[name]),
            "in_range": judge(name, values[name], gpu_type, args.dry_run),
            "why": WHY[name],
        }
        for name in EXPECTED
    ]
    report = {
        "dry_run": args.dry_run,
        "device": info,
        "seconds": time.monotonic() - start,
        "figures": rows,
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        verdict = {True: "ok", False: "OUT OF RANGE", None: "not judged"}[row["in_range"]]
        value = f"{row['value']:.3f}" if isinstance(row["value"], float) else row["value"]
        print(f"  {row['name']:<42} {value!s:>12}  expected {row['expected']:<22} {verdict}")
    failed = [label for label, r in runs.items() if "error" in r]
    for label in failed:
        print(f"  {label}: {runs[label]['error']}")
    timed_out = sum(runs[label]["error"].startswith("TIMED OUT") for label in failed)
    judged = [r["in_range"] for r in rows if r["in_range"] is not None]
    print(
        f"gpu-check: {sum(judged)} of {len(judged)} figures in range, {len(failed)} runs not measured "
        f"({timed_out} timed out), {report['seconds']:.0f} s; wrote {out} (device: {info['device']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
