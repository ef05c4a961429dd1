"""`pretrain bench`: what this machine reaches with a preset's real model, optimizer, parallelism and
compile settings, on synthetic tokens (no data needed): tokens/s, MFU against the device's peak (CPU:
achieved TFLOP/s), peak memory against the estimate, compile time, and where a step's time goes. The
first thing to run on a new node pool (the chart's `bench.enabled`); under torchrun for several GPUs:
`torchrun --nproc-per-node 8 -m app.tools.bench --preset x1-50m`.

The timed steps are the trainer's own (app/trainer/step.py: no host sync); the breakdown comes from a
few extra steps that synchronize the device between phases, so it shows shares, not overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DESCRIPTION = "measure tokens/s, MFU, memory and the step-time breakdown of a preset on synthetic tokens"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.trainer.args import add_config_arguments

    add_config_arguments(p)  # as for `pretrain train`: e.g. --set train.compile=false
    p.add_argument("--steps", type=int, default=20, metavar="N", help="timed optimizer steps (default: 20)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        metavar="N",
        help="untimed steps first; the first one compiles when train.compile is on (default: 3)",
    )
    p.add_argument(
        "--breakdown-steps",
        type=int,
        default=3,
        metavar="N",
        help="extra steps that synchronize between phases for the time breakdown; 0 = none (default: 3)",
    )
    p.add_argument(
        "--gpu-type",
        metavar="T",
        help="key of the peak-FLOPs table for MFU (a100, h100-sxm, h200, b200, l40s, ...; "
        "default: detected from the CUDA device name)",
    )
    p.add_argument(
        "--out",
        metavar="FILE.json",
        help="where to write the results as JSON (default: runs/bench/<preset>.json); also printed last",
    )


class SyntheticBatches:
    """Uniform random token ids, fixed by (seed, rank, micro-step): a loader without a data dir, with the
    interface the Prefetcher reads (`batch_at`, `state.micro_steps`)."""

    def __init__(self, vocab_size: int, seq_len: int, micro_batch: int, rank: int, seed: int) -> None:
        from app.data.loader import LoaderState

        self.vocab, self.T, self.B, self.rank, self.seed = vocab_size, seq_len, micro_batch, rank, seed
        self.state = LoaderState()

    def batch_at(self, micro_step: int):
        import torch

        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.rank + micro_step)
        rows = torch.randint(0, self.vocab, (self.B, self.T + 1), generator=g)
        return rows[:, :-1], rows[:, 1:]


def _check(args: argparse.Namespace) -> None:
    from app.errors import UserError

    for flag, value, low in (
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--breakdown-steps", args.breakdown_steps, 0),
    ):
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    from app.config import load_config, vocab_for_estimates
    from app.files import check_writable_dir

    cfg = load_config(args.preset, args.config, args.overrides, {"metrics.gpu_type": args.gpu_type})
    cfg.model.vocab_size = vocab_for_estimates(cfg)
    out = Path(args.out or f"runs/bench/{cfg.preset}.json")
    check_writable_dir(out.parent, "--out")
    result = measure(cfg, args.steps, args.warmup, args.breakdown_steps)
    if result is None:  # not global rank 0
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for line in describe(result):
        print(line)
    print(f"wrote {out}")
    print(json.dumps(result), flush=True)
    return 0


def measure(cfg, steps: int, warmup: int, breakdown_steps: int) -> dict | None:
    """Run the steps and return the figures (on global rank 0; None elsewhere). Collective."""
    import torch

    from app.data.loader import Prefetcher
    from app.trainer.memory import plan as plan_parallel
    from app.trainer.metrics import device_peak, flops_per_token
    from app.trainer.model import count_parameters
    from app.trainer.optim import build_optimizer, set_lr
    from app.trainer.parallel import build_parallel_model, init_distributed, shutdown_distributed, unwrap
    from app.trainer.runtime import (
        autocast_for,
        compile_enabled,
        configure_device,
        grad_accum_steps,
        pick_device,
    )
    from app.trainer.step import PhaseTimer, StepLog, TrainStep

    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    env = init_distributed("cuda" if cuda else "cpu", cfg.train.collective_timeout_minutes)
    try:
        device = pick_device(cfg, env.local_rank)
        configure_device(device)
        torch.manual_seed(cfg.train.seed)
        choice = plan_parallel(cfg, env.world_size, device)
        quiet = lambda msg: None  # noqa: E731 - the table says it all
        model = build_parallel_model(cfg, env, device, choice.mode, quiet)
        optimizer = build_optimizer(unwrap(model), cfg.optim, device)
        set_lr(optimizer, cfg.optim.lr)
        accum = grad_accum_steps(cfg, env.world_size)
        m, t = cfg.model, cfg.train
        source = SyntheticBatches(m.vocab_size, m.seq_len, t.micro_batch_size, env.rank, t.seed)
        batches = Prefetcher(source, device, t.prefetch)
        log = StepLog(env)
        step = TrainStep(
            model, optimizer, batches, accum, autocast_for(cfg, device), env, cfg.optim.grad_clip, log
        )
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        n = 0
        first_seconds = 0.0
        for i in range(warmup):
            t0 = time.perf_counter()
            step(n := n + 1)
            log.read()  # waits for the device
            if i == 0:
                first_seconds = time.perf_counter() - t0
        env.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(n := n + 1)
        log.read()
        sync()
        seconds = time.perf_counter() - t0
        timer = PhaseTimer(device)
        for _ in range(breakdown_steps):
            step(n := n + 1, timer=timer)
            log.read()
        peak_bytes, how = _peak_memory(device, step, n + 1)
        batches.close()

        tokens_per_step = accum * t.micro_batch_size * m.seq_len * env.world_size
        tps = steps * tokens_per_step / seconds
        fpt = flops_per_token(m)
        gpu_type, peak = device_peak(cfg.metrics.gpu_type, cfg.metrics.peak_tflops, device)
        estimate = (choice.fsdp if choice.mode == "fsdp" else choice.ddp).total
        step_seconds = seconds / steps
        total = sum(timer.seconds.values())
        result = {
            "preset": cfg.preset,
            "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "gpu_type": gpu_type,
            "world_size": env.world_size,
            "parallel": choice.mode,
            "compile": compile_enabled(cfg, device),
            "compile_mode": t.compile_mode,
            "dtype": "bf16"
            if device.type == "cuda" and t.dtype in ("auto", "bf16")
            else t.dtype.replace("auto", "fp32"),
            "parameters": count_parameters(unwrap(model)).total,
            "tokens_per_step": tokens_per_step,
            "layout": {"micro_batch_size": t.micro_batch_size, "seq_len": m.seq_len, "accum": accum},
            "steps": steps,
            "tokens_per_second": tps,
            "step_seconds": step_seconds,
            "flops_per_token": fpt,
            "achieved_tflops_per_device": fpt * tps / env.world_size / 1e12,
            "peak_tflops_per_device": peak / 1e12 if peak else None,
            "mfu": fpt * tps / (peak * env.world_size) if peak else None,
            "peak_memory_bytes": peak_bytes,
            "peak_memory_measured_by": how,
            "estimated_memory_bytes": estimate,
            "first_step_seconds": first_seconds,
            "compile_seconds": max(0.0, first_seconds - step_seconds)
            if compile_enabled(cfg, device)
            else 0.0,
            "breakdown_seconds": {k: v / max(breakdown_steps, 1) for k, v in timer.seconds.items()},
            "breakdown_share": {k: v / total for k, v in timer.seconds.items()} if total else {},
            "torch": torch.__version__,
            "unix_time": time.time(),
        }
        return result if env.is_rank0 else None
    finally:
        shutdown_distributed()


def _peak_memory(device, step, n: int) -> tuple[int | None, str]:
    """Peak bytes of this rank's tensors: CUDA's allocator over every step run; on CPU one more step
    under torch's MemTracker (it follows every storage through the dispatcher; eager only)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # pragma: no cover - older torch
        return None, "this torch has no MemTracker"
    try:
        tracker = MemTracker()
        tracker.track_external(step.model, step.optimizer)
        with tracker:
            step(n)
            step.log.read()
        return int(tracker.get_tracker_snapshot("peak")[device]["Total"]), "MemTracker (one step)"
    except Exception as e:  # a measurement aid: its failure must not hide the other figures
        return None, f"MemTracker failed ({type(e).__name__}; it follows eager tensors only)"


def describe(r: dict) -> list[str]:
    """The human table of a result."""
    gb = lambda b: f"{b / 1e9:.2f} GB" if b is not None else "n/a"  # noqa: E731
    lay = r["layout"]
    lines = [
        f"bench {r['preset']}: {r['world_size']} x {r['device_name']}, {r['parallel']}, {r['dtype']}, "
        f"compile {'on (' + r['compile_mode'] + ')' if r['compile'] else 'off'}, {r['parameters']:,} parameters",
        f"  batch        {r['tokens_per_step']:,} tokens/step ({lay['micro_batch_size']} x {lay['seq_len']} x "
        f"{r['world_size']} ranks x {lay['accum']} accum)",
        f"  throughput   {r['tokens_per_second']:,.0f} tokens/s, {r['step_seconds'] * 1000:.1f} ms/step "
        f"over {r['steps']} free-running steps",
    ]
    if r["mfu"] is not None:
        lines.append(
            f"  MFU          {r['mfu']:.1%} of {r['peak_tflops_per_device']:.0f} TFLOP/s per device "
            f"({r['achieved_tflops_per_device']:.1f} TFLOP/s achieved)"
        )
    else:
        lines.append(
            f"  achieved     {r['achieved_tflops_per_device'] * 1000:.1f} GFLOP/s per device "
            "(no peak known for this device: MFU not computed; --gpu-type or metrics.peak_tflops sets one)"
        )
    est, peak, how = r["estimated_memory_bytes"], r["peak_memory_bytes"], r["peak_memory_measured_by"]
    if peak:
        lines.append(
            f"  memory       peak {gb(peak)} vs estimate {gb(est)} ({peak / est:.2f}x); measured by {how}"
        )
    else:
        lines.append(f"  memory       estimate {gb(est)}; peak not measured: {how}")
    if r["compile"]:
        lines.append(
            f"  compile      first step {r['first_step_seconds']:.1f} s (~{r['compile_seconds']:.1f} s compiling)"
        )
    if r["breakdown_share"]:
        parts = ", ".join(f"{k.replace('_', '+')} {v:.0%}" for k, v in r["breakdown_share"].items())
        lines.append(f"  breakdown    {parts} (synchronized steps)")
        if r["parallel"] == "fsdp" and r["world_size"] > 1:
            lines.append("               FSDP's all-gathers and reduce-scatters are inside forward+backward")
    return lines


def main(argv: list[str] | None = None) -> int:
    from app.command import main_for

    return main_for("pretrain bench", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
