"""The GPT, top to bottom: RMSNorm, rotary positions, grouped-query attention, SwiGLU, and a looped
variant whose middle blocks share weights and run several times.

Plain model:   embed -> blocks[0 .. n_layer) -> norm -> head -> loss
Looped model:  embed -> prelude -> (recurrent blocks) x r -> coda -> norm -> head -> loss
The embedding and head have model.padded_vocab rows (a multiple of 128: the head matmul runs at full
speed); the pad logits are cut off before anything reads them, so every caller sees model.vocab_size.
With deep supervision the coda, norm and head also read out after every recurrence, giving one loss
per loop: a model that learns to refine its answer shows loss_0 > loss_1 > ... > loss_{r-1}. In training
they combine into one objective (app/trainer/supervision.py); in eval mode the loss is the last read-out's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from app.config import ModelConfig
from app.trainer.supervision import loop_weights, objective

RESIDUAL_OUT = ("attn.wo", "mlp.w_down")  # each residual branch's output projection (init scaled down)


class RMSNorm(nn.Module):
    """Scale-only normalization: cheaper than LayerNorm and as good for LMs."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head by a position-dependent angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.size(-2)], sin[: x.size(-2)]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with fewer key/value heads than query heads (GQA) to shrink the KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv = cfg.n_head, cfg.kv_heads
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:  # generation (app/trainer/generate.py): attend to cached positions too
            k, v = kv.append(k, v)
        # Query i sits at position (Tk - T + i) and sees keys up to there: the usual causal mask when
        # Tq == Tk, nothing to mask for one new token, an offset triangle for a chunk after a prefix.
        Tk = k.size(2)
        mask = None if T in (1, Tk) else torch.ones(T, Tk, dtype=torch.bool, device=x.device).tril(Tk - T)
        causal = T > 1 and Tk == T
        gqa = self.n_kv != self.n_head  # K/V heads are shared by groups of query heads, not repeated
        y = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm residual block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        return x + self.mlp(self.mlp_norm(x))


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
        # One flat list of distinct blocks (FSDP wraps each); the loop structure is index ranges.
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_blocks))
        lp = cfg.loop
        self.n_prelude = lp.prelude if cfg.looped else cfg.n_layer
        self.n_recurrent = lp.recurrent if cfg.looped else 0
        self.recurrence = lp.recurrence if cfg.looped else 0
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.tok_emb.weight.is_meta:
            self.reset_parameters()

    def _init_weights(self, module: nn.Module, residual_out: bool) -> None:
        """GPT-2 init; output projections of residual branches scaled by 1/sqrt(2 * depth) so the
        residual stream's variance does not grow with (effective) depth."""
        std = self.cfg.init_std
        if isinstance(module, nn.Linear):
            scale = 1 / math.sqrt(2 * self.cfg.effective_depth) if residual_out else 1.0
            nn.init.normal_(module.weight, mean=0.0, std=std * scale)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def reset_parameters(self) -> None:
        """The init, also after materializing a meta-device model. Residual outputs are found by name, which
        survives a module swap (FP8's Float8Linear) where a marker attribute on the module would not."""
        residual = {id(m) for name, m in self.named_modules() if name.endswith(RESIDUAL_OUT)}
        self.apply(lambda module: self._init_weights(module, id(module) in residual))
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.d_model // self.cfg.n_head, self.cfg.rope_base)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def _coda(self, h: torch.Tensor, cos, sin) -> torch.Tensor:
        for block in self.blocks[self.n_prelude + self.n_recurrent :]:
            h = block(h, cos, sin)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))[..., : self.cfg.vocab_size]  # pad logits never reach a caller

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, head and cross-entropy in one function, which train.compile compiles whole: the
        fp32 upcast fuses into the loss kernel instead of materialising fp32 logits."""
        logits = self.logits(h)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, last_only: bool = False
    ) -> ModelOutput:
        cos, sin = self.rope_cos, self.rope_sin
        h = self.tok_emb(idx)
        for block in self.blocks[: self.n_prelude]:
            h = block(h, cos, sin)
        readouts: list[torch.Tensor] = []  # hidden states to read out (one per loop with deep supervision)
        recurrent = self.blocks[self.n_prelude : self.n_prelude + self.n_recurrent]
        for i in range(self.recurrence):
            for block in recurrent:
                h = block(h, cos, sin)
            if self.cfg.loop.deep_supervision and targets is not None and i < self.recurrence - 1:
                readouts.append(h)
        readouts.append(h)
        if targets is None:
            h = self._coda(h, cos, sin)  # the coda attends to every position
            return ModelOutput(self.logits(h[:, -1:] if last_only else h), None)
        losses = [self.loss(self._coda(r, cos, sin), targets) for r in readouts]
        if len(losses) == 1:
            return ModelOutput(None, losses[0])
        loop_losses = [li.detach() for li in losses]
        if not self.training:  # evaluation: the last read-out is the model's prediction (what sampling uses)
            return ModelOutput(None, losses[-1], loop_losses)
        lp = self.cfg.loop  # deep supervision: weights and improvement term in app/trainer/supervision.py
        terms = objective(losses, loop_weights(lp, len(losses)), lp.improvement_reward_scale)
        return ModelOutput(None, terms.total, loop_losses)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> GPT:
    """Build on `device`; on "meta" nothing is allocated (for counting and FSDP init of big models)."""
    with torch.device(device):
        return GPT(cfg)


@dataclass
class ParamCounts:
    total: int  # distinct parameters (tied weights counted once), vocabulary padding included
    non_embedding: int  # without token embedding and output head
    padding: int = 0  # of `total`: the pad rows of embedding and head (model.padded_vocab - vocab_size)

    def __str__(self) -> str:
        pad = f", {self.padding:,} of them vocabulary padding" if self.padding else ""
        return f"{self.total:,} parameters ({self.non_embedding:,} non-embedding{pad})"


def count_parameters(cfg_or_model: ModelConfig | nn.Module) -> ParamCounts:
    """Exact counts; a config is built on the meta device, so any size is free to count."""
    model = build_model(cfg_or_model, "meta") if isinstance(cfg_or_model, ModelConfig) else cfg_or_model
    total = sum(p.numel() for p in model.parameters())  # .parameters() already dedups tied weights
    emb = model.tok_emb.weight.numel()
    tied = model.head.weight is model.tok_emb.weight
    head = 0 if tied else model.head.weight.numel()
    cfg = model.cfg
    padding = (cfg.padded_vocab - cfg.vocab_size) * cfg.d_model * (1 if tied else 2)
    return ParamCounts(total, total - emb - head, padding)
