"""`pretrain bench`: what this machine reaches with a preset's real model, optimizer, parallelism and
compile settings, on synthetic tokens (no data needed): tokens/s, MFU against the device's peak (CPU:
achieved TFLOP/s), peak memory against the estimate, compile time, and where a step's time goes. The
first thing to run on a new node pool (the chart's `bench.enabled`); under torchrun for several GPUs:
`torchrun --nproc-per-node 8 -m app.tools.bench --preset x1-50m`.

The timed steps are the trainer's own (app/train.py train_step: no host sync); the breakdown comes from
a few extra steps that synchronize the device between phases, so it shows shares, not overlap.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

DESCRIPTION = "measure tokens/s, MFU, memory and the step-time breakdown of a preset on synthetic tokens"


# (flag, default, minimum, help) of the step counts
_COUNTS = (
    ("--steps", 20, 1, "timed optimizer steps"),
    ("--warmup", 3, 0, "untimed steps first; the first one compiles when train.compile is on"),
    ("--breakdown-steps", 3, 0, "extra steps synchronized between phases for the time breakdown; 0 = none"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.trainer.args import add_config_arguments

    add_config_arguments(p)  # as for `pretrain train`: e.g. --set train.compile=false
    for flag, default, _, doc in _COUNTS:
        p.add_argument(flag, type=int, default=default, metavar="N", help=f"{doc} (default: {default})")
    gpu_types = "a100, h100-sxm, h200, b200, l40s, ...; default: detected from the CUDA device name"
    p.add_argument("--gpu-type", metavar="T", help=f"key of the peak-FLOPs table for MFU ({gpu_types})")
    out = "where to write the results as JSON (default: runs/bench/<preset>.json); also printed last"
    p.add_argument("--out", metavar="FILE.json", help=out)
    p.add_argument("--force", action="store_true", help="replace an existing --out FILE")


class SyntheticBatches:
    """Uniform random token ids, fixed by (seed, rank, micro-step): a loader without a data dir, with the
    interface the Prefetcher reads (`rows_at`, `state.micro_steps`)."""

    def __init__(self, vocab_size: int, seq_len: int, micro_batch: int, rank: int, seed: int) -> None:
        from app.data.loader import LoaderState

        self.vocab, self.T, self.B, self.rank, self.seed = vocab_size, seq_len, micro_batch, rank, seed
        self.state = LoaderState()

    def rows_at(self, micro_step: int):
        import torch

        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.rank + micro_step)
        return torch.randint(0, self.vocab, (self.B, self.T + 1), generator=g, dtype=torch.int32)


def run(args: argparse.Namespace) -> int:
    from app.config import load_config, vocab_for_estimates
    from app.errors import UserError
    from app.files import check_writable_dir
    from app.trainer import planning

    for flag, _, low, _ in _COUNTS:
        if (value := getattr(args, flag[2:].replace("-", "_"))) < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    cfg = load_config(args.preset, args.config, args.overrides, {"metrics.gpu_type": args.gpu_type})
    # the planning step, as `pretrain train` runs it: a model that cannot fit is refused before it is built
    planning.plan(cfg, more_gpus="measure it on more or larger GPUs (torchrun -m app.tools.bench ...)")
    cfg.model.vocab_size = vocab_for_estimates(cfg)
    out = Path(args.out or f"runs/bench/{cfg.preset}.json")
    if args.out and out.exists() and not args.force:
        raise UserError(f"--out {out} exists; choose a new file, or add --force to replace it")
    check_writable_dir(out.parent, "--out")
    result = measure_or_explain(cfg, args.steps, args.warmup, args.breakdown_steps)
    if result is None:  # not global rank 0
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(describe(result)))
    print(f"wrote {out}")
    print(json.dumps(result), flush=True)
    return 0


def measure_or_explain(cfg, steps: int, warmup: int, breakdown_steps: int) -> dict | None:
    """measure(), with an out-of-memory error as one line that names the setting to try (exit 2): a bench is
    how a user finds the micro-batch that fits, so running out is an answer, not a crash."""
    import torch

    from app.errors import UserError
    from app.trainer.parallel.layout import smaller_micro_batch

    auto = cfg.train.micro_batch_size == "auto"
    try:
        return measure(cfg, steps, warmup, breakdown_steps)
    except torch.OutOfMemoryError:
        t, m = cfg.train, cfg.model
        smaller = smaller_micro_batch(cfg, 1 if not t.batch_tokens else _world_size())
        try_instead = (
            f"--set train.micro_batch_size={smaller}"
            if smaller
            else "--set train.activation_checkpointing=true or a smaller model.seq_len"
        )
        raise UserError(
            f"out of memory at micro-batch {t.micro_batch_size} x seq {m.seq_len} (preset {cfg.preset}"
            f"{', chosen by micro-batch auto' if auto else ''}): "
            f"rerun with {try_instead}"
        ) from None


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def measure(cfg, steps: int, warmup: int, breakdown_steps: int) -> dict | None:
    """Run the steps and return the figures (on global rank 0; None elsewhere). Collective."""
    import torch

    from app.data.loader import Prefetcher
    from app.train import train_step
    from app.trainer.model.gpt import count_parameters
    from app.trainer.optimization.optimizer import build_optimizer
    from app.trainer.parallel import layout
    from app.trainer.parallel.distributed import init_distributed, shutdown_distributed
    from app.trainer.parallel.memory import plan_for_training as plan_parallel
    from app.trainer.parallel.parallelize import build_parallel_model, compile_counts, unwrap
    from app.trainer.parallel.runtime import (
        autocast_for,
        compile_enabled,
        configure_device,
        grad_accum_steps,
        pick_device,
    )
    from app.trainer.reporting.metrics import device_peak, flops_per_token
    from app.trainer.reporting.steplog import StepLog
    from app.trainer.stopping.agreement import auto_every

    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    env = init_distributed("cuda" if cuda else "cpu", cfg.train.collective_timeout_minutes)
    stack = contextlib.ExitStack()
    stack.callback(shutdown_distributed)
    with stack:
        device = pick_device(cfg, env.local_rank)
        configure_device(device)
        auto = layout.for_run(cfg, env.world_size, device, None, None, lambda msg: None)  # micro-batch auto
        torch.manual_seed(cfg.train.seed)
        choice = plan_parallel(cfg, env.world_size, device)
        model = build_parallel_model(cfg, env, device, choice.mode, lambda msg: None)  # the table says it all
        optimizer = build_optimizer(unwrap(model), cfg.optim, device)
        accum = grad_accum_steps(cfg, env.world_size)
        m, t = cfg.model, cfg.train
        source = SyntheticBatches(m.vocab_size, m.seq_len, t.micro_batch_size, env.rank, t.seed)
        batches = Prefetcher(source, device, t.prefetch)
        stack.callback(batches.close)  # also after an error: no reading thread left inside torch at exit
        log = StepLog(env)
        parts = dict(
            model=model,
            optimizer=optimizer,
            batches=batches,
            accum=accum,
            autocast=autocast_for(cfg, device),
            grad_clip=cfg.optim.grad_clip,
            lr=cfg.optim.lr,
            log=log,
        )
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        compiles_before = compile_counts()
        n, first_seconds = 0, 0.0
        for i in range(warmup):
            t0 = time.perf_counter()
            train_step(step=(n := n + 1), **parts)
            log.read()  # waits for the device
            if i == 0:
                first_seconds = time.perf_counter() - t0
        env.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(step=(n := n + 1), **parts)
        log.read()
        sync()
        seconds = time.perf_counter() - t0
        phases: dict[str, float] = {}
        for _ in range(breakdown_steps):
            _timed_step(parts, env, sync, phases)
        peak_bytes, how = _peak_memory(device, lambda: (train_step(step=n + 1, **parts), log.read()), parts)
        agreement = _agreement_seconds()
        compiles = {k: v - compiles_before[k] for k, v in compile_counts().items()}
        tokens_per_step = accum * t.micro_batch_size * m.seq_len * env.world_size
        tps = steps * tokens_per_step / seconds
        fpt = flops_per_token(m)
        gpu_type, peak = device_peak(cfg.metrics.gpu_type, cfg.metrics.peak_tflops, device)
        step_seconds = seconds / steps
        total = sum(phases.values())
        compiled = compile_enabled(cfg, device)
        bf16 = device.type == "cuda" and t.dtype in ("auto", "bf16")
        result = {
            "preset": cfg.preset,
            "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "gpu_type": gpu_type,
            "world_size": env.world_size,
            "parallel": choice.mode,
            "compile": compiled,
            "compile_mode": t.compile_mode,
            "compile_backend": t.compile_backend,
            "dtype": "bf16" if bf16 else t.dtype.replace("auto", "fp32"),
            "parameters": count_parameters(unwrap(model)).total,
            "tokens_per_step": tokens_per_step,
            "layout": {
                "micro_batch_size": t.micro_batch_size,
                "seq_len": m.seq_len,
                "accum": accum,
                "micro_batch_rule": "auto" if auto else "fixed",
            },
            "vocab": {"size": m.vocab_size, "padded": m.padded_vocab},
            "head_flops_share": 1 - flops_per_token(dataclasses.replace(m, vocab_size=0)) / fpt,
            "steps": steps,
            "tokens_per_second": tps,
            "step_seconds": step_seconds,
            "flops_per_token": fpt,
            "achieved_tflops_per_device": fpt * tps / env.world_size / 1e12,
            "peak_tflops_per_device": peak / 1e12 if peak else None,
            "mfu": fpt * tps / (peak * env.world_size) if peak else None,
            "peak_memory_bytes": peak_bytes,
            "peak_memory_measured_by": how,
            "estimated_memory_bytes": (choice.fsdp if choice.mode == "fsdp" else choice.ddp).total,
            "first_step_seconds": first_seconds,
            "compile_seconds": max(0.0, first_seconds - step_seconds) if compiled else 0.0,
            "compiled_graphs": compiles["graphs"],
            "recompiles": compiles["recompiles"],
            "graph_breaks": compiles["graph_breaks"],
            "breakdown_seconds": {k: v / max(breakdown_steps, 1) for k, v in phases.items()},
            "breakdown_share": {k: v / total for k, v in phases.items()} if total else {},
            "stop_agreement_seconds": agreement,
            "stop_check_every": auto_every(agreement, step_seconds),
            "torch": torch.__version__,
            "unix_time": time.time(),
        }
        return result if env.is_rank0 else None


def _timed_step(parts: dict, env, sync, phases: dict[str, float]) -> None:
    """One optimizer step of the trainer's, taken apart so each phase can be timed: the device is
    synchronized between phases, and under DDP the gradients are all-reduced on their own, after the
    backward passes, instead of overlapping them."""
    import torch
    import torch.distributed as dist

    from app.trainer.optimization.optimizer import step_unless
    from app.trainer.parallel.parallelize import clip_grad_norm

    model, accum = parts["model"], parts["accum"]
    separate_comm = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    marks = [("start", time.perf_counter())]

    def mark(phase: str) -> None:
        sync()
        marks.append((phase, time.perf_counter()))

    for _ in range(accum):
        x, y = parts["batches"].next()
        mark("data")
        with model.no_sync() if separate_comm else contextlib.nullcontext(), parts["autocast"]:
            out = model(x, y)
        (out.loss / accum).backward()
        mark("forward_backward")
    if separate_comm:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= env.world_size
        mark("communication")
    norm = clip_grad_norm(model, parts["grad_clip"] or float("inf"))
    step_unless(parts["optimizer"], (~torch.isfinite(norm)).float())
    parts["optimizer"].zero_grad(set_to_none=True)
    mark("optimizer")
    for (_, before), (phase, after) in zip(marks, marks[1:], strict=False):
        phases[phase] = phases.get(phase, 0.0) + after - before


def _agreement_seconds(calls: int = 20) -> float:
    """The cost of the trainer's stop agreement (app/trainer/stopping/agreement.py): the cheapest of a few."""
    from app.trainer.parallel.distributed import agree

    costs = []
    for _ in range(calls):
        t0 = time.perf_counter()
        agree([0, 0, 0, 1])
        costs.append(time.perf_counter() - t0)
    return min(costs)


def _peak_memory(device, one_step, parts: dict) -> tuple[int | None, str]:
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
        tracker.track_external(parts["model"], parts["optimizer"])
        with tracker:
            one_step()
        return int(tracker.get_tracker_snapshot("peak")[device]["Total"]), "MemTracker (one step)"
    except Exception as e:  # a measurement aid: its failure must not hide the other figures
        return None, f"MemTracker failed ({type(e).__name__}; it follows eager tensors only)"


def describe(r: dict) -> list[str]:
    from app.trainer.parallel.parallelize import compile_how

    gb = lambda b: f"{b / 1e9:.2f} GB" if b is not None else "n/a"  # noqa: E731
    lay = r["layout"]
    auto = lay.get("micro_batch_rule") == "auto"
    est, peak, how = r["estimated_memory_bytes"], r["peak_memory_bytes"], r["peak_memory_measured_by"]
    # a record written before the backend was a setting compiled with inductor
    how_compiled = compile_how(r["compile_mode"], r.get("compile_backend", "inductor"))
    lines = [
        f"bench {r['preset']}: {r['world_size']} x {r['device_name']}, {r['parallel']}, {r['dtype']}, "
        f"compile {'on (' + how_compiled + ')' if r['compile'] else 'off'}, {r['parameters']:,} parameters",
        f"  batch        {r['tokens_per_step']:,} tokens/step ({lay['micro_batch_size']} x {lay['seq_len']} x "
        f"{r['world_size']} ranks x {lay['accum']} accum"
        f"{'; micro-batch auto: the most that fits by the estimate' if auto else ''})",
        f"  vocab        {r['vocab']['size']:,} padded to {r['vocab']['padded']:,} rows for the head matmul, "
        f"which is {r['head_flops_share']:.0%} of the step's FLOPs",
        f"  throughput   {r['tokens_per_second']:,.0f} tokens/s, {r['step_seconds'] * 1000:.1f} ms/step "
        f"over {r['steps']} free-running steps",
        f"  MFU          {r['mfu']:.1%} of {r['peak_tflops_per_device']:.0f} TFLOP/s per device "
        f"({r['achieved_tflops_per_device']:.1f} TFLOP/s achieved)"
        if r["mfu"] is not None
        else f"  achieved     {r['achieved_tflops_per_device'] * 1000:.1f} GFLOP/s per device "
        "(no peak known for this device: MFU not computed; --gpu-type or metrics.peak_tflops sets one)",
        f"  memory       peak {gb(peak)} vs estimate {gb(est)} ({peak / est:.2f}x); measured by {how}"
        if peak
        else f"  memory       estimate {gb(est)}; peak not measured: {how}",
    ]
    k, cost = r["stop_check_every"], r["stop_agreement_seconds"]
    lines.append(
        f"  stops        agreement {cost * 1e3:.3f} ms = {cost / r['step_seconds']:.2%} of a step; auto k = {k} "
        f"(overhead {cost / k / r['step_seconds']:.2%}, a stop waits up to {k * r['step_seconds']:.2f} s)"
    )
    if r["compile"]:
        s, c = r["first_step_seconds"], r["compile_seconds"]
        lines.append(
            f"  compile      first step {s:.1f} s (~{c:.1f} s compiling); compiled: every block and the loss "
            f"(norm, head, cross-entropy): 100% of the FLOPs counted, {r['head_flops_share']:.0%} of them the head; "
            f"{r['compiled_graphs']} graphs, {r['recompiles']} recompiles, {r['graph_breaks']} graph breaks"
        )
    if r["breakdown_share"]:
        parts = ", ".join(f"{k.replace('_', '+')} {v:.0%}" for k, v in r["breakdown_share"].items())
        lines.append(f"  breakdown    {parts} (synchronized steps)")
        if r["parallel"] == "fsdp" and r["world_size"] > 1:
            lines.append("               FSDP's all-gathers and reduce-scatters are inside forward+backward")
    return lines


if __name__ == "__main__":
    from app.command import main_for

    sys.exit(main_for("pretrain bench", DESCRIPTION, add_arguments, run))
