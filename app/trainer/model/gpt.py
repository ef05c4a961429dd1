"""The GPT, top to bottom: RMSNorm, rotary positions, grouped-query attention, SwiGLU (or ReLU squared),
and a looped variant whose middle blocks share weights and run several times.

Plain model:   embed -> blocks[0 .. n_layer) -> norm -> head -> loss
Looped model:  embed -> prelude -> (recurrent blocks) x r -> coda -> norm -> head -> loss
The embedding and head have model.padded_vocab rows (a multiple of 128: the head matmul runs at full
speed); the pad logits are cut off before anything reads them, so every caller sees model.vocab_size.
With deep supervision the coda, norm and head also read out after every recurrence, giving one loss
per loop: a model that learns to refine its answer shows loss_0 > loss_1 > ... > loss_{r-1}. In training
they combine into one objective (app/trainer/model/supervision.py); in eval mode the loss is the last read-out's.

The model switches of docs/recipes.md ("Model switches"; all off by default) change what a block is fed
besides its input: value embeddings (token tables mixed into the attention values), the embedding itself
(x0 skip) and an earlier block's output (U-net skips). GPT.run_block feeds them, for training and for
generation alike, so a cached decode step sees what the full forward sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from app.config import ModelConfig
from app.trainer.model.supervision import loop_weights, objective

RESIDUAL_OUT = ("attn.wo", "mlp.w_down")  # each residual branch's output projection (init scaled down)
LOSS_CHUNK_BYTES = 1 << 20  # CPU: the cross-entropy's rows in chunks of this many bytes of logits (GPT.loss)


def cpu_kernels(x: torch.Tensor) -> bool:
    """Whether x takes the CPU paths of RMSNorm, RoPE and the loss: eager fp32 on a CPU (a laptop run), where
    a step waits on memory traffic more than on FLOPs (docs/performance.md, "CPU"). Compiled code (inductor
    fuses the formulas into a kernel each) and eager bf16 autocast (a GPU's eager path, whose memory the
    estimate in app/trainer/parallel/memory.py was measured on) run the formulas."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


class RMSNorm(nn.Module):
    """Scale-only normalization: cheaper than LayerNorm and as good for LMs. gain=False: no learned
    scale (the record's and nanochat's norms). Computed in fp32, returned in the input's dtype."""

    def __init__(self, dim: int, eps: float, gain: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels(x):
            return _CpuRMSNorm.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight).to(x.dtype)


class _CpuRMSNorm(torch.autograd.Function):
    """rms_norm with its backward written out (cpu_kernels: fp32): autograd's chain of five ops (square,
    mean, rsqrt, two products) and their backward walk the activations about twice as often. It agrees
    with the formula to fp32 rounding (the mean square is a dot product: 1e-7 relative) and saves what
    the chain saves (the input, the inverse RMS and, before a gain, the normalized input)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        inv_rms = torch.linalg.vecdot(x, x).unsqueeze(-1).div_(x.size(-1)).add_(eps).rsqrt_()
        y = x * inv_rms
        if weight is None:
            ctx.save_for_backward(x, inv_rms)
            return y
        ctx.save_for_backward(x, inv_rms, y, weight)
        return y * weight

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        # y = x r, r = (mean(x^2) + eps)^-1/2: dL/dx = r (g - y mean(g y)), g the gradient at y
        x, inv_rms, *gained = ctx.saved_tensors
        d = x.size(-1)
        if not gained:  # r g - x (r^3 mean(g x)), without materializing y
            scale = torch.linalg.vecdot(g, x).unsqueeze(-1).mul_(inv_rms.pow(3)).div_(d)
            return torch.addcmul(g * inv_rms, x, scale, value=-1), None, None
        y, weight = gained
        grad_weight = torch.linalg.vecdot(g.reshape(-1, d), y.reshape(-1, d), dim=0)
        g = g * weight
        mean_gy = torch.linalg.vecdot(g, y).unsqueeze(-1).div_(d)
        return g.addcmul_(y, mean_gy, value=-1).mul_(inv_rms), grad_weight, None


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head by a position-dependent angle. cos and sin hold
    the positions of x's rows: (T, head_dim/2) for a sequence, or any shape that broadcasts (one position
    per batch row in the server's continuous batch). Computed in fp32, returned in x's dtype."""
    return _CpuRope.apply(x, cos, sin) if cpu_kernels(x) else rope(x, cos, sin)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """(x1 cos - x2 sin, x1 sin + x2 cos), each half written in place into one new tensor laid out with
    `stride`."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x1, sin, out=o2).addcmul_(x2, cos)
    return out


class _CpuRope(torch.autograd.Function):
    """apply_rope in two passes over the activations each way (cpu_kernels; the formula's four products,
    sum, difference and concatenation take about 1.3x the time); its backward is the rotation by the
    opposite angle. The output is laid out as the formula's (the attention kernel keeps it, and the
    memory estimate counts its layout); the gradient keeps the layout of the input, q or k as their
    projection wrote them (batch, position, head), so that the projection's backward reads it without a
    copy. It agrees with the formula to fp32 rounding (a product and a sum are fused: 5e-7 absolute) and,
    as the formula, saves only the tables."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.stride = torch.empty_like(x, device="meta").stride()  # x's own layout (where it is dense)
        return _rotate(x, cos, sin, torch.empty(x.shape, device="meta").stride())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin, ctx.stride), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (N, V) logits, reduced in fp32. With cpu_kernels, over chunks of rows that a
    cache holds (the same sum in another order: 1e-7 relative), and without a log-softmax of the whole
    batch: its buffers are above glibc's mmap threshold, so each would be fresh pages from the kernel,
    zeroed, every step (3-6% of a CPU step, docs/performance.md)."""
    if not cpu_kernels(logits):
        return F.cross_entropy(logits.float(), targets)
    rows = max(1, LOSS_CHUNK_BYTES // (4 * logits.size(-1)))
    chunks = zip(logits.split(rows), targets.split(rows), strict=True)
    return sum(F.cross_entropy(x, t, reduction="sum") for x, t in chunks) / targets.numel()


class Attention(nn.Module):
    """Causal self-attention with fewer key/value heads than query heads (GQA) to shrink the KV cache."""

    def __init__(self, cfg: ModelConfig, value_embed: bool = False) -> None:
        super().__init__()
        self.n_head, self.n_kv = cfg.n_head, cfg.kv_heads
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)
        self.qk_norm = RMSNorm(self.head_dim, cfg.norm_eps, gain=False) if cfg.qk_norm else None
        self.scale = cfg.attn_scale or None  # None: SDPA's 1/sqrt(head_dim)
        # value embeddings: v -> value_mix[0] * v + value_mix[1] * (this token's row of the block's table)
        self.value_mix = nn.Parameter(torch.full((2,), 0.5)) if value_embed else None
        self.fused = False  # q, k and v in one matmul (fuse_projections)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None, ve: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if self.fused:
            q, k, v = fused_linear(x, self.wq, self.wk, self.wv)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.value_mix is not None:
            mix = self.value_mix.to(v.dtype)  # a (2,) weight would promote bf16 values to fp32
            v = mix[0] * v + mix[1] * ve.to(v.dtype).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if kv is not None:  # generation (app/trainer/model/generate.py): attend to cached positions too
            k, v, mask = kv.append(k, v)
        causal = T > 1 and k.size(2) == T  # a whole sequence; the cache gives the mask otherwise
        gqa = self.n_kv != self.n_head  # K/V heads are shared by groups of query heads, not repeated
        y = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=self.scale, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)
        self.fused = False  # gate and up in one matmul (fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_linear(x, self.w_gate, self.w_up) if self.fused else (self.w_gate(x), self.w_up(x))
        return self.w_down(F.silu(gate) * up)


def fused_linear(x: torch.Tensor, *layers: nn.Linear) -> tuple[torch.Tensor, ...]:
    """Each layer's x W^T from one matmul against their weights stacked: one large GEMM instead of several
    narrow ones, and in backward one input gradient instead of a sum of several. The weights stay separate
    parameters (checkpoints, Muon's per-matrix orthogonalisation, FSDP shards and FP8's choice of layers
    see them as before); the stacking copies them once per forward, a few MB against the activations'
    hundreds (docs/performance.md, "Fused projections")."""
    weight = torch.cat([layer.weight for layer in layers])
    return F.linear(x, weight).split([layer.out_features for layer in layers], dim=-1)


def fuse_projections(model: nn.Module, on: bool = True) -> int:
    """Run q/k/v and SwiGLU's gate/up as one matmul each (`on`), or as separate ones; returns how many
    modules run fused. A module whose layers are not plain nn.Linear (FP8's Float8Linear, a subclass)
    stays unfused: its layers' own forward is the point."""
    fused = 0
    for module in model.modules():
        if isinstance(module, Attention):
            layers = (module.wq, module.wk, module.wv)
        elif isinstance(module, SwiGLU):
            layers = (module.w_gate, module.w_up)
        else:
            continue
        module.fused = on and all(type(layer) is nn.Linear for layer in layers)
        fused += module.fused
    return fused


class ReLU2(nn.Module):
    """relu(x W_up)^2 W_down (So et al., "Primer"): the record's MLP, two matrices instead of three."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.relu(self.w_up(x)).square())


class Block(nn.Module):
    """Pre-norm residual block."""

    def __init__(self, cfg: ModelConfig, value_embed: bool = False) -> None:
        super().__init__()
        gain = not cfg.parameter_free_norms
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, gain)
        self.attn = Attention(cfg, value_embed)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, gain)
        self.mlp = (ReLU2 if cfg.mlp == "relu2" else SwiGLU)(cfg.d_model, cfg.ffn_dim)
        # x0 skip: the input becomes resid_scale * x + x0_scale * embedding (two weights: FSDP shards each)
        self.resid_scale = nn.Parameter(torch.ones(1)) if cfg.x0_skip else None
        self.x0_scale = nn.Parameter(torch.zeros(1)) if cfg.x0_skip else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv=None,
        ve: torch.Tensor | None = None,
        x0: torch.Tensor | None = None,
        skip: torch.Tensor | None = None,
        skip_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x, and what the switches feed the block (GPT.run_block): its value-embedding rows `ve`, the
        embedding `x0`, a U-net skip `skip` from its mirror block, added with `skip_weight`. Each is mixed
        in here, inside the block, so a compiled block compiles it too."""
        if skip is not None:
            x = x + skip_weight * skip
        if self.x0_scale is not None:
            # (1,)-shaped weights would promote a bf16 residual stream to fp32
            x = self.resid_scale.to(x.dtype) * x + self.x0_scale.to(x.dtype) * x0
        x = x + self.attn(self.attn_norm(x), cos, sin, kv, ve)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class Stream:
    """What one forward pass feeds its blocks besides the hidden state: the embedding (x0 skip), the
    value-embedding lookups (one per table) and the early blocks' outputs kept for U-net skips."""

    x0: torch.Tensor | None
    values: list[torch.Tensor]
    kept: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # last read-out's logits, true vocab (None when targets are given)
    loss: torch.Tensor | None  # training: the objective (deep supervision: S - s*I); eval: last read-out's CE
    loop_losses: list[torch.Tensor] = field(default_factory=list)  # per recurrence, detached


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set before building the model")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.d_model)
        self.embed_norm = RMSNorm(cfg.d_model, cfg.norm_eps, gain=False) if cfg.embed_norm else None
        # Value embeddings: lookups only (no matmul), so the true vocabulary's rows, no padding.
        kv_dim = cfg.kv_heads * (cfg.d_model // cfg.n_head)
        self.value_embeds = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, kv_dim) for _ in range(cfg.value_embeds)
        )
        self.value_table = cfg.value_embed_tables  # per block: the table it reads, or None
        # One flat list of distinct blocks (FSDP wraps each); the loop structure is index ranges.
        self.blocks = nn.ModuleList(Block(cfg, table is not None) for table in self.value_table)
        # U-net skips: block `late` adds skip_weights[j] x the output of block `early`, for pair j
        pairs = cfg.skip_pairs
        self.skip_from = {late: (j, early) for j, (early, late) in enumerate(pairs)}
        self.skip_sources = {early for early, _ in pairs}
        self.skip_weights = nn.Parameter(torch.ones(len(pairs))) if pairs else None
        lp = cfg.loop
        self.n_prelude = lp.prelude if cfg.looped else cfg.n_layer
        self.n_recurrent = lp.recurrent if cfg.looped else 0
        self.recurrence = lp.recurrence if cfg.looped else 0
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, gain=not cfg.parameter_free_norms)
        self.head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Under autocast, the dtype of the residual stream and of the elementwise work on it (the embedding
        # is cast to it): bf16 halves their memory traffic (train.activation_dtype); None: the embedding's.
        self.residual_dtype: torch.dtype | None = None
        if not self.tok_emb.weight.is_meta:
            self.reset_parameters()

    def _init_weights(self, module: nn.Module, residual_out: bool) -> None:
        """GPT-2 init; output projections of residual branches scaled by 1/sqrt(2 * depth) so the
        residual stream's variance does not grow with (effective) depth, or zero with model.zero_init
        (every block starts as the identity; the record's and nanochat's init), as does an untied head.
        The switches' mixing weights start neutral: x0 off, U-net skips on, v and its table half each."""
        std = self.cfg.init_std
        untied_head = module is self.head and not self.cfg.tie_embeddings
        if isinstance(module, nn.Linear) and self.cfg.zero_init and (residual_out or untied_head):
            nn.init.zeros_(module.weight)
        elif isinstance(module, nn.Linear):
            scale = 1 / math.sqrt(2 * self.cfg.effective_depth) if residual_out else 1.0
            nn.init.normal_(module.weight, mean=0.0, std=std * scale)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm) and module.weight is not None:
            nn.init.ones_(module.weight)
        elif isinstance(module, Block) and module.x0_scale is not None:
            nn.init.ones_(module.resid_scale)
            nn.init.zeros_(module.x0_scale)
        elif isinstance(module, Attention) and module.value_mix is not None:
            nn.init.constant_(module.value_mix, 0.5)
        elif module is self and self.skip_weights is not None:
            nn.init.ones_(self.skip_weights)

    def reset_parameters(self) -> None:
        """The init, also after materializing a meta-device model. Residual outputs are found by name, which
        survives a module swap (FP8's Float8Linear) where a marker attribute on the module would not."""
        residual = {id(m) for name, m in self.named_modules() if name.endswith(RESIDUAL_OUT)}
        self.apply(lambda module: self._init_weights(module, id(module) in residual))
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.d_model // self.cfg.n_head, self.cfg.rope_base)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def embed(self, idx: torch.Tensor) -> tuple[torch.Tensor, Stream]:
        """The first hidden state, and the stream of extra block inputs the switches ask for."""
        h, values = self.embeddings(idx)
        return h, Stream(h if self.cfg.x0_skip else None, values)

    def embeddings(self, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The token embedding (normalized with model.embed_norm, in the residual dtype) and each value
        table's rows: lookups, which train.compile compiles like a block (app/trainer/parallel/parallelize.py)."""
        h = self.tok_emb(idx)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        if self.residual_dtype is not None and torch.is_autocast_enabled(h.device.type):
            h = h.to(self.residual_dtype)
        return h, [table(idx) for table in self.value_embeds]

    def run_order(self) -> list[int]:
        """Block indices in the order a forward pass runs them (recurrent ones once per recurrence)."""
        p, r = self.n_prelude, self.n_recurrent
        return [*range(p), *list(range(p, p + r)) * self.recurrence, *range(p + r, len(self.blocks))]

    def run_block(self, i: int, h: torch.Tensor, cos, sin, stream: Stream, kv=None) -> torch.Tensor:
        """Block i on h, fed what the switches give it: a U-net skip from its mirror block, its value
        embedding, the embedding. Generation (app/trainer/model/generate.py) runs the blocks through here too."""
        skip = weight = None
        if i in self.skip_from:
            j, early = self.skip_from[i]
            skip, weight = stream.kept[early], self.skip_weights[j]
        table = self.value_table[i]
        ve = None if table is None else stream.values[table]
        h = self.blocks[i](h, cos, sin, kv, ve, stream.x0, skip, weight)
        if i in self.skip_sources:
            stream.kept[i] = h
        return h

    def _coda(self, h: torch.Tensor, cos, sin, stream: Stream) -> torch.Tensor:
        for i in range(self.n_prelude + self.n_recurrent, len(self.blocks)):
            h = self.run_block(i, h, cos, sin, stream)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(h))[..., : self.cfg.vocab_size]  # pad logits never reach a caller
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(logits.float() / cap) if cap else logits

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, head and cross-entropy in one function, which train.compile compiles whole: the
        fp32 upcast fuses into the loss kernel instead of materialising fp32 logits."""
        logits = self.logits(h)
        return cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, last_only: bool = False
    ) -> ModelOutput:
        cos, sin = self.rope_cos[: idx.size(1)], self.rope_sin[: idx.size(1)]
        h, stream = self.embed(idx)
        for i in range(self.n_prelude):
            h = self.run_block(i, h, cos, sin, stream)
        readouts: list[torch.Tensor] = []  # hidden states to read out (one per loop with deep supervision)
        recurrent = range(self.n_prelude, self.n_prelude + self.n_recurrent)
        for loop in range(self.recurrence):
            for i in recurrent:
                h = self.run_block(i, h, cos, sin, stream)
            if self.cfg.loop.deep_supervision and targets is not None and loop < self.recurrence - 1:
                readouts.append(h)
        readouts.append(h)
        if targets is None:
            h = self._coda(h, cos, sin, stream)  # the coda attends to every position
            return ModelOutput(self.logits(h[:, -1:] if last_only else h), None)
        losses = [self.loss(self._coda(r, cos, sin, stream), targets) for r in readouts]
        if len(losses) == 1:
            return ModelOutput(None, losses[0])
        loop_losses = [li.detach() for li in losses]
        if not self.training:  # evaluation: the last read-out is the model's prediction (what sampling uses)
            return ModelOutput(None, losses[-1], loop_losses)
        lp = (
            self.cfg.loop
        )  # deep supervision: weights and improvement term in app/trainer/model/supervision.py
        terms = objective(losses, loop_weights(lp, len(losses)), lp.improvement_reward_scale)
        return ModelOutput(None, terms.total, loop_losses)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> GPT:
    """Build on `device`; on "meta" nothing is allocated (for counting and FSDP init of big models)."""
    with torch.device(device):
        return GPT(cfg)


@dataclass
class ParamCounts:
    total: int  # distinct parameters (tied weights counted once), vocabulary padding included
    non_embedding: int  # without token embedding, value embeddings and output head
    padding: int = 0  # of `total`: the pad rows of embedding and head (model.padded_vocab - vocab_size)

    def __str__(self) -> str:
        pad = f", {self.padding:,} of them vocabulary padding" if self.padding else ""
        return f"{self.total:,} parameters ({self.non_embedding:,} non-embedding{pad})"


def count_parameters(cfg_or_model: ModelConfig | nn.Module) -> ParamCounts:
    """Exact counts; a config is built on the meta device, so any size is free to count."""
    model = build_model(cfg_or_model, "meta") if isinstance(cfg_or_model, ModelConfig) else cfg_or_model
    total = sum(p.numel() for p in model.parameters())  # .parameters() already dedups tied weights
    emb = model.tok_emb.weight.numel() + sum(p.numel() for p in model.value_embeds.parameters())
    tied = model.head.weight is model.tok_emb.weight
    head = 0 if tied else model.head.weight.numel()
    cfg = model.cfg
    padding = (cfg.padded_vocab - cfg.vocab_size) * cfg.d_model * (1 if tied else 2)
    return ParamCounts(total, total - emb - head, padding)
