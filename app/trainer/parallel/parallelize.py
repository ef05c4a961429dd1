"""The model as a run trains it: optional FP8 layers, activation checkpointing, regional compilation,
then DDP (every rank holds the whole model) or FSDP2 (each block, then the root, sharded over the ranks;
docs/parallel.md). None of these changes a parameter's name, so checkpoints are the same whatever the
wrapping. train.parallel=auto is resolved by app/trainer/parallel/memory.py before the model is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from app.trainer.parallel.distributed import DistEnv

# Above this many bytes of fp32 weights an FSDP run on CPU also starts on the meta device (on CUDA it
# always does): each rank then never holds more than its shard.
META_INIT_CPU_BYTES = 4 << 30


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside DDP (an FSDP model is the GPT itself, sharded)."""
    return model.module if isinstance(model, DDP) else model


def grad_sync(model: torch.nn.Module, last_micro_batch: bool):
    """DDP all-reduces gradients in the backward of the last micro-batch only. FSDP2 reduce-scatters every
    micro-batch: keeping unsharded gradients between micro-batches would cost a full copy per GPU."""
    if isinstance(model, DDP) and not last_micro_batch:
        return model.no_sync()
    return contextlib.nullcontext()


def compile_blocks(model: torch.nn.Module, mode: str, backend: str = "inductor") -> None:
    """Regional compilation: torch.compile each block's forward, the loss (final norm, head,
    cross-entropy) and the embeddings (token and value-table lookups, embedding norm, the cast to the
    residual dtype) in place, so names, hence checkpoints, do not change. What runs between them is no
    tensor work: the U-net skips and the x0 mix are added inside the blocks (Block.forward). One graph
    per input shape for all blocks alike (a block fed a value embedding or a skip is another kind: one
    graph more each), so compile time is about one block's; the module's hooks (FSDP2's gathers, activation
    checkpointing) stay outside the graphs. fullgraph=True: a graph break is an error, not a silent slowdown.
    dynamic=False: a new micro-batch size (after an out-of-memory halving) compiles static kernels again
    instead of graphs with a symbolic batch size, which are slower and would serve every later step (and
    with a symbolic sequence length SDPA's is_causal becomes symbolic, which fullgraph refuses). `backend`
    aot_eager traces the same graphs and runs them without generating kernels (modes are inductor's).
    Evaluation and sampling run these blocks eagerly (app/trainer/model/evaluate.py): no compile for their
    shapes or for no-grad mode."""
    kwargs = {"fullgraph": True, "dynamic": False, "backend": backend}
    if mode != "default" and backend == "inductor":
        kwargs["mode"] = mode
    for block in model.blocks:
        block.forward = torch.compile(block.forward, **kwargs)
    model.loss = torch.compile(model.loss, **kwargs)
    model.embeddings = torch.compile(model.embeddings, **kwargs)


def compile_how(mode: str, backend: str) -> str:
    """How blocks are compiled, in words: inductor's mode, or the other backend (modes are inductor's)."""
    return f"mode {mode}" if backend == "inductor" else f"backend {backend}"


def forget_compiled_graphs() -> None:
    """Drop every compiled graph (the next call compiles anew): after an out-of-memory halving the graphs
    of the old micro-batch never run again, and their kernels (CUDA graphs under max-autotune) hold memory."""
    torch.compiler.reset()


def compile_counts() -> dict[str, int]:
    """Since the process started: graphs compiled, of which recompiles (a guard failed on an input shape, a
    dtype or grad mode; 0 in a healthy run, `make gpu-check` reports it), and graph breaks (fullgraph=True
    makes a break an error, so 0 unless compile is used elsewhere)."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = [m for m in get_compilation_metrics() if m.co_name]  # frames (a backward's entry has none)
    return {
        "graphs": len(metrics),
        "recompiles": sum(m.recompile_reason is not None for m in metrics),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block in backward instead of keeping its activations (non-reentrant,
    composable: parameter names do not change, so checkpoints do not either)."""
    from torch.distributed._composable import checkpoint

    for block in model.blocks:
        checkpoint(block)


def shard_model(model: torch.nn.Module, device: torch.device, dtype: str = "auto") -> torch.nn.Module:
    """FSDP2: fully_shard every block, then the root (embedding, final norm, head). In place.

    The last block keeps its parameters gathered after forward (backward needs them at once; FSDP2 does
    the same for the root), and in a plain model each block gathers the next one's parameters as it starts
    (forward) and the previous one's (backward): explicit prefetch, so a gather overlaps a block's compute
    even when the CPU runs behind. The looped model's blocks run in a data-dependent order (a recurrence
    repeats them): FSDP2's own prefetch, which follows the order it saw, serves it. Whether the prefetch
    overlaps needs GPUs to see (streams); tests/test_fsdp.py checks the wiring on 2 gloo ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torch >= 2.6 (features.py)

    bf16 = device.type == "cuda" and dtype in ("auto", "bf16")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=mp or MixedPrecisionPolicy(), reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=mp or MixedPrecisionPolicy())
    if not model.cfg.looped:
        for earlier, later in zip(blocks, blocks[1:], strict=False):
            earlier.set_modules_to_forward_prefetch([later])
            later.set_modules_to_backward_prefetch([earlier])
    return model


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (the same two functions it runs), returning the global norm as a plain
    tensor on every rank. Under FSDP2 the norm is a partial sum over shards: it is reduced exactly once
    here and the clip coefficient comes from that reduced norm, whatever a torch version's
    clip_grad_norm_ does with a DTensor norm before the loop's full_tensor() (the review counted two
    collectives on the base's torch; torch 2.13 on CPU does one)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding each rank's share
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def materialize(model: torch.nn.Module, device: torch.device, seed: int, rank: int) -> None:
    """Allocate a meta-device model (after sharding: this rank's shards) and run the GPT init. On CUDA
    DTensor's RNG tracker draws all shards from one stream; on CPU each rank draws from its own seed (a
    valid i.i.d. init, not the numbers of an unsharded build)."""
    model.to_empty(device=device)
    if device.type == "cuda":
        with torch.no_grad():
            model.reset_parameters()
        return
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1_000_003 * rank)
        model.reset_parameters()


def build_parallel_model(
    cfg,
    env: DistEnv,
    device: torch.device,
    mode: str,
    log: Callable[[str], None] = print,
    meta_init: bool | None = None,
) -> torch.nn.Module:
    """The GPT for `mode` (ddp | fsdp, resolved from auto); `unwrap()` gives the GPT back. With the same
    seed DDP and FSDP (built unsharded, then sharded) start from the same weights; `meta_init` (default:
    FSDP on CUDA, or weights above 4 GiB) builds on the meta device and materializes only local shards."""
    from app.trainer.features import require
    from app.trainer.model.gpt import build_model, fuse_projections
    from app.trainer.parallel.fp8 import convert_to_fp8, fp8_mode
    from app.trainer.parallel.memory import param_split
    from app.trainer.parallel.runtime import (
        compile_enabled,
        compile_mode_for,
        fused_projections,
        residual_dtype,
    )

    fsdp = mode == "fsdp" and env.distributed
    require(
        cfg, fsdp, compile_enabled(cfg, device)
    )  # a feature this torch lacks: one line now, not an error in the first step
    if mode == "fsdp" and not env.distributed:
        log("train.parallel=fsdp with one process: nothing to shard, training unsharded")
    if meta_init is None:
        meta_init = device.type == "cuda" or 4 * param_split(cfg.model).total > META_INIT_CPU_BYTES
    meta_init = meta_init and fsdp
    model = build_model(cfg.model, "meta" if meta_init else device)
    if fp8_mode(cfg.train.fp8) != "false":
        convert_to_fp8(model, device, log, fp8_mode(cfg.train.fp8), fsdp=fsdp)
    model.residual_dtype = residual_dtype(cfg, device)
    if fused_projections(cfg, device):  # after FP8: its Float8Linear layers keep their own matmuls
        fused = fuse_projections(model)
        log(f"fused projections: {fused} q/k/v and gate/up groups run as one matmul each")
    if cfg.drill.oom_above:  # out of memory above a micro-batch size (app/trainer/parallel/layout.py)
        from app.trainer.parallel.layout import oom_drill

        model.register_forward_hook(oom_drill(cfg.drill.oom_above, cfg.drill.oom_rank))
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile_enabled(cfg, device):
        compile_mode = compile_mode_for(cfg.train.compile_mode, fsdp, log)
        backend = cfg.train.compile_backend
        compile_blocks(model, compile_mode, backend)
        log(
            f"compile: {len(model.blocks)} blocks and the loss, and the embeddings, "
            f"{compile_how(compile_mode, backend)} "
            "(compiled at the first step)"
        )
    if fsdp:
        shard_model(model, device, cfg.train.dtype)
        if meta_init:
            materialize(model, device, cfg.train.seed, env.rank)
        return model
    if not env.distributed:
        return model
    # gradients as views into the all-reduce buckets: no second copy of the gradients
    return DDP(
        model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )
