"""Memory per GPU before anything is allocated (weights, gradients, optimizer state, activations, buffers,
for DDP and FSDP at a world size) and the `train.parallel=auto` decision built on it. The terms and
their check against torch's tracker: docs/parallel.md ("Memory estimate").

Activations per token of one block (d = d_model, kv = KV width, f = SwiGLU width, h = heads; a = bytes
of matmul inputs/outputs: 2 under bf16 autocast, 4 in fp32; the residual stream and RMSNorm stay fp32
in eager mode; r = bytes of the residual stream compiled: 2 when train.activation_dtype makes it bf16).
Eager (train.compile off), what autograd saves op by op:

    attention  block input 4d, normalized 4d, linear inputs (4d once in fp32; 3 bf16 casts 3*2d under
               autocast), rotated q a*d and k a*kv, v a*kv, SDPA output a*d and logsumexp 4h (flash
               kernels save no T x T matrix), the re-laid-out output a*d
    MLP        input 4d, normalized 4d, linear inputs (4d, or 2 casts 2*2d), gate/up/silu/product 4*a*f

Compiled (each block one graph: the norms fused, their output cast once, silu recomputed in backward):
the block input r*d, the normalized inputs of attention and MLP a*d each, q a*d, k and v a*kv each, the
SDPA output a*d and logsumexp 4h, the re-laid-out output a*d, the attention output a*d (the MLP norm's
input is recomputed from it), gate/up/product 3*a*f.

The read-out adds, eager, the final norm (4d + 4d + its cast) and the fp32 log-softmax (4V; the logits
themselves are not kept); compiled, the norm's input r*d and cast a*d and the logits as the head writes
them (a*V_padded; log-softmax is recomputed in backward); and the int64 inputs and targets. Both were
measured on CPU against what autograd saves (tests/test_memory.py: MemTracker for eager in fp32 and bf16
autocast, the compiled graphs' saved tensors for compiled); on a GPU `pretrain bench` and `make gpu-check`
compare the allocator's peak with it.

The logits' gradients, at the start of backward (logit_grad_bytes): eager, 8V (d(log-softmax) and
d(logits), fp32). Compiled, the loss's backward is one pointwise kernel (softmax minus the one-hot, from
the logits, max and log-sum-exp the forward saved) that writes d(logits) in the logits' dtype into the
saved logits' own buffer, which nothing reads after it (inductor's in-place buffer reuse: `buf1 =
reinterpret_tensor(mm, ...); del mm  # reuse` in its generated code): nothing beyond the a*V_padded the
activations count. With the soft-cap the backward takes two kernels: an fp32 (N, V) intermediate and the
padded gradient a*V_padded beside the saved logits (4V + a*V_padded), and the forward keeps no tanh.
Measured on CPU from the allocator's running total, which sees inductor's buffers (tests/test_memory.py);
the buffer plan is inductor's, not the device's, and `make gpu-check` compares the GPU allocator's peak.

The model switches (docs/recipes.md) change these terms: ReLU squared keeps up and its square (2*a*f) and
casts its input once; parameter-free norms keep no normalized copy before a gain (-4d per norm); QK-norm
keeps q and k before the norm (4d + 4kv) and their inverse RMS; the x0 skip keeps each block's input
before the mix (4d) and the embedding once; a block with a value embedding keeps v before the mix and the
table's row in the value dtype; the soft-cap keeps its tanh (4V per read-out; compiled, nothing: see
above); an embedding norm keeps the raw embedding (4d). U-net skips keep nothing new: the early block's
output is kept as the next input. Compiled, the switches' block terms are eager's (an upper bound: only
the default model's compiled block terms are measured), ReLU squared keeping 2*a*f for 3*a*f.

With activation checkpointing each block keeps only its fp32 input (4d), and the inputs every block reads
stay (the x0 skip's embedding, the value tables' rows 4kv each, the raw embedding under its norm). The
peak is the larger of the end of forward (the read-out, then the logits' gradients) and the recompute of
one block in backward: its tensors as above plus its MLP's gradients at their widest, 2*a*f for SwiGLU,
3*a*f for ReLU squared (the square's, 2 relu(x)'s and their product's). Measured on CPU with every switch
(tests/test_memory.py): 1-7% above MemTracker's peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from app.config import Config, ModelConfig
from app.errors import UserError
from app.gpus import normalize, with_memory
from app.trainer.model.supervision import readouts_and_blocks_run

GB = 1e9
GIB = 1 << 30
HEADROOM = 0.9  # auto: DDP must fit in this share of the device memory
CUDA_OVERHEAD = 3 * GIB  # CUDA context (~0.5-1 GiB), NCCL buffers (~1 GiB), allocator fragmentation

# Device memory by GPU type, for planning on a machine without the GPU: app/gpus.py's table (what
# torch.cuda.mem_get_info reports as the device's total on that GPU), so that a plan and the run's
# train.micro_batch_size=auto, which asks the device itself, pick the same micro-batch.
GPU_MEMORY_GB = with_memory()


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (per process) of one parallel mode at one world size."""

    mode: str  # ddp | fsdp
    world_size: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int

    @property
    def static(self) -> int:
        """What stays allocated between steps: weights, gradients, optimizer state."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.static + self.activations + self.buffers + self.overhead

    def describe(self) -> str:
        unit, div = ("GB", GB) if self.total >= GB else ("MB", 1e6)
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / div:.2f}" for f in fields(self)[2:])
        return (
            f"{self.mode.upper()} x{self.world_size}: {self.total / div:.1f} {unit} per GPU ({parts} {unit})"
        )


@dataclass(frozen=True)
class ParamSplit:
    """Distinct parameters: total, the largest block, the rest (embedding, value embeddings, final norm,
    head, U-net skip weights)."""

    total: int
    block: int
    root: int
    linear: int  # parameters of nn.Linear layers (the ones autocast copies to bf16)
    matrices: int = 0  # the 2-D weights inside the blocks (Muon's with optim.name=muon)


def _kv(m: ModelConfig) -> int:
    return m.kv_heads * (m.d_model // m.n_head)


def param_split(m: ModelConfig) -> ParamSplit:
    d, kv, f = m.d_model, _kv(m), m.ffn_dim
    block_linear = d * d * 2 + 2 * d * kv + m.mlp_matrices * d * f  # wq, wo, wk, wv, the MLP's
    gains = 0 if m.parameter_free_norms else d
    x0_mix = 2 if m.x0_skip else 0  # resid_scale, x0_scale
    value_mixes = 2 * sum(t is not None for t in m.value_embed_tables)  # attn.value_mix
    block = block_linear + 2 * gains + x0_mix + (2 if value_mixes else 0)  # two RMSNorm gains
    root = m.padded_vocab * d * (1 if m.tie_embeddings else 2) + gains  # embedding, head, final norm
    root += m.value_embeds * m.vocab_size * kv + len(m.skip_pairs)
    linear = m.n_blocks * block_linear + m.padded_vocab * d  # the head's matmul weight, tied or not
    total = m.n_blocks * (block_linear + 2 * gains + x0_mix) + value_mixes + root
    return ParamSplit(total, block, root, linear, m.n_blocks * block_linear)


def _runs_of_block(m: ModelConfig, i: int) -> int:
    """How often distinct block i runs in one training forward (each extra read-out reruns the coda)."""
    if not m.looped:
        return 1
    readouts, _ = readouts_and_blocks_run(m)
    lp = m.loop
    return 1 if i < lp.prelude else m.loop.recurrence if i < lp.prelude + lp.recurrent else readouts


def readout_bytes(m: ModelConfig, autocast: bool, compiled: bool, residual: int = 4) -> int:
    """What one read-out (final norm, head, cross-entropy) keeps for backward, per token: module docstring.
    `residual`: bytes per element of the residual stream (2 with train.activation_dtype bf16)."""
    d, a = m.d_model, 2 if autocast else 4
    if compiled:
        return residual * d + a * d + a * m.padded_vocab + 12
    gain = 0 if m.parameter_free_norms else 4 * d
    softcap = 4 * m.vocab_size if m.logit_softcap else 0
    return 4 * d + gain + (2 * d if autocast else 4 * d) + 4 * m.vocab_size + softcap


def logit_grad_bytes(m: ModelConfig, autocast: bool, compiled: bool) -> int:
    """The logits' gradients at the start of backward beyond what the read-out keeps, per token (module
    docstring): eager 8V; compiled, written in place of the saved logits (0), or with the soft-cap an
    fp32 intermediate and the padded gradient (4V + a*V_padded)."""
    if not compiled:
        return 8 * m.vocab_size
    if not m.logit_softcap:
        return 0
    return 4 * m.vocab_size + (2 if autocast else 4) * m.padded_vocab


def activation_bytes(
    m: ModelConfig,
    micro_batch: int,
    autocast: bool,
    checkpointing: bool,
    compiled: bool = False,
    residual: int = 4,
) -> int:
    """Peak saved activations of one micro-batch (forward done, backward about to start). `residual`: bytes
    per element of the residual stream, 2 with a bf16 one (train.activation_dtype), which the compiled
    terms count; the eager terms count it fp32, an upper bound (eager is not the GPU default)."""
    d, kv, f, h = m.d_model, _kv(m), m.ffn_dim, m.n_head
    a = 2 if autocast else 4
    r = residual if compiled else 4
    gain = 0 if m.parameter_free_norms else 4 * d  # the normalized copy a norm's gain keeps
    qk = 4 * d + 4 * kv + 4 * (h + m.kv_heads) if m.qk_norm else 0
    x0 = r * d if m.x0_skip else 0
    # per token of one block, then of one read-out (final norm, logits, loss): module docstring
    if compiled:
        mlp = (3 if m.mlp == "swiglu" else 2) * a * f
        per_block = r * d + 6 * a * d + 2 * a * kv + 4 * h + 8 + mlp + qk + x0
    else:
        attention = 4 * d + gain + (3 * 2 * d if autocast else 4 * d) + 3 * a * d + 2 * a * kv + 4 * h + qk
        casts = m.mlp_matrices - 1  # the MLP's matrices that read the normalized input
        mlp = 4 * d + gain + (casts * 2 * d if autocast else 4 * d) + (4 if m.mlp == "swiglu" else 2) * a * f
        per_block = attention + mlp + x0
    readout_one = readout_bytes(m, autocast, compiled, r)
    readouts, blocks_run = readouts_and_blocks_run(m)
    readout = readouts * readout_one
    # once per forward: the raw embedding under a norm, the embedding for the x0 skip, the table lookups;
    # per run of a block with a value embedding: v before the mix and (autocast) the row in bf16
    once = (
        (4 * d if m.embed_norm else 0)
        + (r * d if m.x0_skip else 0)
        + (0 if autocast else 4 * kv) * m.value_embeds
    )
    ve_runs = sum(_runs_of_block(m, i) for i, t in enumerate(m.value_embed_tables) if t is not None)
    once += ve_runs * (a * kv + (2 * kv if autocast else 0))
    if checkpointing:
        # module docstring; estimate() counts the logits' gradients as buffers, but they are freed before
        # the recompute, which therefore needs only what exceeds them
        inputs = (4 * d if m.embed_norm else 0) + (r * d if m.x0_skip else 0) + 4 * kv * m.value_embeds
        value_mix = a * kv + (2 * kv if autocast else 0) if m.value_embeds else 0
        mlp_grads = (3 if m.mlp == "relu2" else 2) * a * f
        recompute = per_block + value_mix + mlp_grads - logit_grad_bytes(m, autocast, compiled)
        live = blocks_run * r * d + inputs + max(readout, recompute)
    else:
        live = blocks_run * per_block + readout + once
    return micro_batch * m.seq_len * (live + 16)  # + the int64 inputs and targets


def checkpoint_bytes(cfg: Config, optimizer: bool = True) -> int:
    """One checkpoint on disk: the fp32 weights (a tied head once) and the optimizer state (the JSON files
    are noise). model.vocab_size must be set."""
    e = estimate(cfg.model, 1, "ddp", 1, cuda=False, optimizer=cfg.optim.name)
    return e.weights + (e.optimizer if optimizer else 0)


def volume_line(cfg: Config, prefix: str = "# ") -> str:
    """The checkpoint size and the volume a run needs: keep_last, the best and the one being written can
    be there at once (retention runs after a commit)."""
    c, one = cfg.checkpoint, checkpoint_bytes(cfg)
    slots = c.keep_last + int(c.keep_best) + 1
    need = 2 * one + (slots - 2) * checkpoint_bytes(cfg, False) if c.drop_optimizer_older else slots * one
    older = ", the older ones without optimizer state" if c.drop_optimizer_older else ""
    return (
        f"{prefix}checkpoint: {one / GB:.2f} GB each (fp32 weights + {cfg.optim.name} state); checkpoint "
        f"volume: at least {need / GB:.2f} GB (checkpoint.keep_last={c.keep_last} + {int(c.keep_best)} best "
        f"+ 1 being written{older})"
    )


def estimate(
    m: ModelConfig,
    micro_batch: int,
    mode: str,
    world_size: int,
    *,
    checkpointing: bool = False,
    cuda: bool = True,
    bf16: bool = True,
    optimizer: str = "adamw",
    compiled: bool = False,
    autocast: bool | None = None,
    residual: int = 4,
) -> MemoryEstimate:
    """Bytes per GPU. `bf16` means bf16 autocast (DDP) / bf16 parameters (FSDP mixed precision), which the
    trainer uses on CUDA; on CPU everything is fp32 unless `autocast` (train.dtype=bf16 on a CPU).
    `compiled`: the blocks and the loss run compiled (train.compile), which saves fewer activations.
    `residual`: 2 for a bf16 residual stream (train.activation_dtype under autocast), else 4."""
    mixed = cuda and bf16 if autocast is None else autocast
    n = max(1, world_size)
    ps = param_split(m)
    P = ps.total
    act = activation_bytes(m, micro_batch, mixed, checkpointing, compiled, residual if mixed else 4)
    logit_grads = micro_batch * m.seq_len * logit_grad_bytes(m, mixed, compiled)
    muon = ps.matrices if optimizer == "muon" else 0  # block matrices
    opt_bytes = 8 * P - 4 * muon
    overhead = CUDA_OVERHEAD if cuda else 0
    if mode == "fsdp" and n > 1:
        pb = 2 if mixed else 4  # unsharded parameter dtype
        shard = -(-P // n)
        # root params stay unsharded from forward to backward; two blocks in flight (current + prefetch);
        # one block's unsharded gradients in param dtype plus fp32 for the reduce-scatter
        buffers = pb * ps.root + 2 * pb * ps.block + (pb + 4) * ps.block + logit_grads
        if muon:  # the gathered update (fp32) and Newton-Schulz's bf16 iterate, Gram matrix and product
            big = max(m.d_model, m.ffn_dim) * max(m.d_model, _kv(m), m.ffn_dim)
            buffers += 4 * big + 3 * 2 * big
        return MemoryEstimate("fsdp", n, 4 * shard, 4 * shard, -(-opt_bytes // n), act, buffers, overhead)
    buffers = (2 * ps.linear if mixed else 0) + logit_grads  # autocast's bf16 weight copies
    return MemoryEstimate("ddp", n, 4 * P, 4 * P, opt_bytes, act, buffers, overhead)


def compiles(cfg: Config, cuda: bool) -> bool:
    """train.compile as the trainer resolves it: auto is on for CUDA (fused kernels pay), off for CPU
    (compile time dominates)."""
    return cfg.train.compile == "true" or (cfg.train.compile == "auto" and cuda)


def estimates(cfg: Config, world_size: int, cuda: bool) -> dict[str, MemoryEstimate]:
    """Both modes for a resolved config (model.vocab_size must be set)."""
    t = cfg.train
    autocast = (cuda and t.dtype in ("auto", "bf16")) or t.dtype == "bf16"
    kw = dict(
        checkpointing=t.activation_checkpointing,
        cuda=cuda,
        bf16=t.dtype in ("auto", "bf16"),
        compiled=compiles(cfg, cuda),
        autocast=autocast,
        # the residual stream's dtype as app/trainer/parallel/runtime.py resolves train.activation_dtype
        residual=2 if autocast and t.activation_dtype != "fp32" else 4,
    )
    return {
        mode: estimate(cfg.model, t.micro_batch_size, mode, world_size, optimizer=cfg.optim.name, **kw)
        for mode in ("ddp", "fsdp")
    }


def device_memory_bytes(cfg: Config, device=None) -> tuple[int | None, str]:
    """(bytes of one device, where that number came from) or (None, why unknown)."""
    if cfg.train.device_memory_gb > 0:
        return int(cfg.train.device_memory_gb * GB), "train.device_memory_gb"
    if device is not None and getattr(device, "type", device) == "cuda":
        import torch

        _, total = torch.cuda.mem_get_info(device)
        return int(total), f"CUDA device {torch.cuda.get_device_name(device)}"
    for key in (normalize(k) for k in (cfg.metrics.gpu_type, cfg.budget.gpu_type) if k):
        if key in GPU_MEMORY_GB:
            return int(GPU_MEMORY_GB[key] * GB), f"GPU type {key}"
    return None, "unknown (no CUDA device; set train.device_memory_gb to plan for one)"


@dataclass(frozen=True)
class ParallelChoice:
    mode: str  # ddp | fsdp: what the trainer will run
    reason: str  # one line
    ddp: MemoryEstimate
    fsdp: MemoryEstimate
    device_bytes: int | None
    device_source: str  # where device_bytes came from, or why it is unknown


def choose(
    requested: str, ddp: MemoryEstimate, fsdp: MemoryEstimate, device_bytes: int | None, world_size: int
) -> tuple[str, str]:
    """`auto` -> FSDP exactly when DDP does not fit the device (with 10% headroom) and there is more than
    one rank to shard over; an explicit ddp/fsdp is kept."""
    if requested in ("ddp", "fsdp"):
        return requested, f"train.parallel={requested}"
    if world_size <= 1:
        return "ddp", "one process: nothing to shard"
    if device_bytes is None:
        return "ddp", "device memory unknown: assuming DDP fits (set train.device_memory_gb to plan)"
    usable = device_bytes * HEADROOM
    have = f"{usable / GB:.1f} GB usable of {device_bytes / GB:.1f} GB"
    if ddp.total <= usable:
        return "ddp", f"DDP fits: {ddp.total / GB:.1f} GB per GPU, {have}"
    why = f"DDP needs {ddp.total / GB:.1f} GB per GPU, {have}; FSDP needs {fsdp.total / GB:.1f} GB"
    if fsdp.total > usable:
        why += (
            " (FSDP does not fit either: lower micro_batch_size, enable activation_checkpointing or add GPUs)"
        )
    return "fsdp", why


def plan(cfg: Config, world_size: int, device=None, cuda: bool | None = None) -> ParallelChoice:
    """The estimates for this config and world size, and the mode the trainer runs. `cuda`: plan for
    CUDA (default: whether `device` is a CUDA device)."""
    cuda = getattr(device, "type", device) == "cuda" if cuda is None else cuda
    est = estimates(cfg, world_size, cuda)
    dev, source = device_memory_bytes(cfg, device)
    mode, reason = choose(cfg.train.parallel, est["ddp"], est["fsdp"], dev, world_size)
    return ParallelChoice(mode, reason, est["ddp"], est["fsdp"], dev, source)


def host_memory_bytes() -> int:
    """This machine's memory, or the container's cgroup limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        return min(total, int(open("/sys/fs/cgroup/memory.max").read()))  # noqa: SIM115
    except (OSError, ValueError):  # no cgroup v2 file, or "max"
        return total


def plan_for_training(cfg: Config, world_size: int, device) -> ParallelChoice:
    """plan(), refusing in one line a config whose estimate exceeds the device's memory (on CPU: this
    machine's, shared by its ranks): it would fail in its first step, or swap for hours."""
    c = plan(cfg, world_size, device)
    est = c.fsdp if c.mode == "fsdp" else c.ddp
    if getattr(device, "type", device) == "cuda":
        import torch

        have, where, need = torch.cuda.mem_get_info(device)[1], "the GPU", est.total
    else:
        have, where = host_memory_bytes(), "this machine (all its ranks)"
        need = est.total * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if need > have:
        raise UserError(
            f"this config does not fit: estimate {est.describe()}, {need / GB:,.1f} GB against "
            f"{have / GB:,.1f} GB on {where}; lower train.micro_batch_size or model.seq_len, set "
            "train.activation_checkpointing=true, or use more GPUs (see `pretrain train --print-config`)"
        )
    return c


def planned_world_size(cfg: Config) -> int:
    """For --print-config: WORLD_SIZE when launched by torchrun, else --gpus (budget.gpus), else 1."""
    env = os.environ.get("WORLD_SIZE")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return cfg.budget.gpus or 1


def plans_for_cuda(cfg: Config) -> bool:
    """--print-config plans for GPUs unless the run is on CPU: train.device=cuda, a visible CUDA device,
    or a GPU count / type / memory given on the command line."""
    t = cfg.train
    if t.device != "auto":
        return t.device == "cuda"
    import torch

    hint = cfg.budget.gpus or cfg.budget.gpu_type or cfg.metrics.gpu_type or t.device_memory_gb > 0
    return bool(torch.cuda.is_available() or hint)


def print_lines(cfg: Config, world_size: int) -> list[str]:
    """What `pretrain train --print-config` shows (as YAML comments)."""
    import torch

    t, cuda = cfg.train, plans_for_cuda(cfg)
    c = plan(cfg, world_size, torch.device("cuda", 0) if cuda and torch.cuda.is_available() else None, cuda)
    where = ("CUDA, bf16" if t.dtype in ("auto", "bf16") else "CUDA, fp32") if cuda else "CPU, fp32"
    lines = [
        f"# memory per GPU at world size {world_size} ({where}; micro-batch {t.micro_batch_size} x "
        f"seq {cfg.model.seq_len}; activation checkpointing {'on' if t.activation_checkpointing else 'off'}; "
        f"{'compiled' if compiles(cfg, cuda) else 'eager'}; GB = 1e9 bytes):",
        f"#   {c.ddp.describe()}",
        *([f"#   {c.fsdp.describe()}"] if world_size > 1 else []),
        f"#   device memory: {c.device_bytes / GB:.1f} GB ({c.device_source})"
        if c.device_bytes
        else f"#   device memory: {c.device_source}",
        f"#   train.parallel={t.parallel} -> {c.mode}: {c.reason}",
    ]
    chosen = c.fsdp if c.mode == "fsdp" else c.ddp
    if not cuda and chosen.total > (host := host_memory_bytes()):
        lines.append(
            f"#   note: this does not fit this machine ({host / GB:,.1f} GB), so training here is refused; "
            "--gpus N --gpu-type T plans it for GPUs"
        )
    if c.device_bytes is None and cuda and t.parallel == "auto" and world_size > 1:
        h100 = int(GPU_MEMORY_GB["h100-sxm"] * GB)
        alt, why = choose("auto", c.ddp, c.fsdp, h100, world_size)
        lines.append(f"#   on H100s ({h100 / GB:.0f} GB) auto would pick {alt}: {why}")
    if world_size == 1:
        lines.append(
            "#   (pass --gpus N, or run under torchrun, to plan for N GPUs; FSDP needs more than one)"
        )
    return [*lines, volume_line(cfg)]
