"""The GPT, top to bottom: RMSNorm, rotary positions, grouped-query attention, SwiGLU, and a looped
variant whose middle blocks share weights and run several times.

Plain model:   embed -> blocks[0 .. n_layer) -> norm -> head
Looped model:  embed -> prelude -> (recurrent blocks) x r -> coda -> norm -> head
With deep supervision the coda, norm and head also read out after every recurrence, giving one loss
per loop: a model that learns to refine its answer shows loss_0 > loss_1 > ... > loss_{r-1}. In training
they combine into one objective (app/trainer/supervision.py); in eval mode the loss is the last read-out's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from app.config import ModelConfig
from app.trainer.supervision import loop_weights, objective

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


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


class LayerKV:
    """One attention call's keys and values for the positions seen so far (preallocated to the window)."""

    def __init__(self, batch: int, n_kv: int, seq_len: int, head_dim: int, device, dtype) -> None:
        self.k = torch.zeros(batch, n_kv, seq_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.n = 0  # positions filled

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys/values; return those of every position so far."""
        t = k.size(2)
        self.k[:, :, self.n : self.n + t] = k
        self.v[:, :, self.n : self.n + t] = v
        self.n += t
        return self.k[:, :, : self.n], self.v[:, :, : self.n]


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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:  # generation: attend to the cached earlier positions too
            k, v = kv.append(k, v)
        # Query i sits at position (Tk - T + i) and sees keys up to there: the usual causal mask when
        # Tq == Tk, nothing to mask for one new token, an offset triangle for a chunk after a prefix.
        Tk = k.size(2)
        mask = None if T in (1, Tk) else torch.ones(T, Tk, dtype=torch.bool, device=x.device).tril(Tk - T)
        causal = T > 1 and Tk == T
        if self.n_kv != self.n_head:
            if _SDPA_HAS_GQA:
                y = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=True)
            else:
                rep = self.n_head // self.n_kv
                y = F.scaled_dot_product_attention(
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), mask, is_causal=causal
                )
        else:
            y = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)  # flash/mem-efficient on GPU
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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # last read-out's logits (None when only the loss was asked for)
    loss: torch.Tensor | None  # training: the objective (deep supervision: S - s*I); eval: last read-out's CE
    loop_losses: list[torch.Tensor] = field(default_factory=list)  # per recurrence, detached


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set before building the model")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # One flat list of distinct blocks (FSDP wraps each); the loop structure is index ranges.
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_blocks))
        lp = cfg.loop
        self.n_prelude = lp.prelude if cfg.looped else cfg.n_layer
        self.n_recurrent = lp.recurrent if cfg.looped else 0
        self.recurrence = lp.recurrence if cfg.looped else 0
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for block in self.blocks:
            block.attn.wo._is_residual_out = True
            block.mlp.w_down._is_residual_out = True
        if not self.tok_emb.weight.is_meta:
            self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init; output projections of residual branches scaled by 1/sqrt(2 * depth) so the
        residual stream's variance does not grow with (effective) depth."""
        std = self.cfg.init_std
        if isinstance(module, nn.Linear):
            scale = 1.0
            if getattr(module, "_is_residual_out", False):
                scale = 1 / math.sqrt(2 * self.cfg.effective_depth)
            nn.init.normal_(module.weight, mean=0.0, std=std * scale)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def reset_parameters(self) -> None:
        """Re-run init, e.g. after materializing a meta-device model."""
        self.apply(self._init_weights)
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.d_model // self.cfg.n_head, self.cfg.rope_base)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def _readout(self, h: torch.Tensor, cos, sin, last_only: bool = False) -> torch.Tensor:
        for block in self.blocks[self.n_prelude + self.n_recurrent :]:
            h = block(h, cos, sin)
        return self.head(self.norm(h[:, -1:] if last_only else h))  # the coda attends to every position

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
            logits = self._readout(h, cos, sin, last_only)
            return ModelOutput(logits, None)
        losses = []
        logits = None
        for r in readouts:
            logits = self._readout(r, cos, sin)
            losses.append(F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1)))
        if len(losses) == 1:
            return ModelOutput(logits, losses[0])
        loop_losses = [li.detach() for li in losses]
        if not self.training:  # evaluation: the last read-out is the model's prediction (what sampling uses)
            return ModelOutput(logits, losses[-1], loop_losses)
        lp = self.cfg.loop  # deep supervision: weights and improvement term in app/trainer/supervision.py
        terms = objective(losses, loop_weights(lp, len(losses)), lp.improvement_reward_scale)
        return ModelOutput(logits, terms.total, loop_losses)

    # ------------------------------------------------------------ generation

    def run_order(self) -> list[Block]:
        """Blocks in the order a forward pass runs them (recurrent ones once per recurrence)."""
        recurrent = list(self.blocks[self.n_prelude : self.n_prelude + self.n_recurrent])
        prelude, coda = self.blocks[: self.n_prelude], self.blocks[self.n_prelude + self.n_recurrent :]
        return [*prelude, *recurrent * self.recurrence, *coda]

    def new_cache(self, batch: int) -> list[LayerKV]:
        """An empty KV cache: one LayerKV per block run (a recurrent block sees new inputs each loop)."""
        hd, w = self.cfg.d_model // self.cfg.n_head, self.tok_emb.weight
        return [
            LayerKV(batch, self.cfg.kv_heads, self.cfg.seq_len, hd, w.device, w.dtype)
            for _ in self.run_order()
        ]

    def decode(self, idx: torch.Tensor, cache: list[LayerKV]) -> torch.Tensor:
        """Logits (B, vocab) of the token after `idx`, given the positions already in `cache`.
        Same read-out as forward(idx, last_only=True) on the whole sequence, at the cost of `idx` alone."""
        pos, t = cache[0].n, idx.size(1)
        cos, sin = self.rope_cos[pos : pos + t], self.rope_sin[pos : pos + t]
        h = self.tok_emb(idx)
        for block, kv in zip(self.run_order(), cache, strict=True):
            h = block(h, cos, sin, kv)
        return self.head(self.norm(h[:, -1:]))[:, -1]

    @torch.no_grad()
    def generate_stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 50,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Iterator[torch.Tensor]:
        """Yield the sampled tokens (B, 1), one step at a time, for streaming.

        With the KV cache a step runs the model on one new token. The window is cfg.seq_len positions
        (the RoPE table); when it is full the context slides by a quarter window: the newest 3/4 are
        re-encoded in one pass and decoding goes on. Without the cache every step re-reads the whole
        (cropped) context; inside the window both give the same tokens.
        """
        window = self.cfg.seq_len
        cache: list[LayerKV] | None = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(idx[:, -window:], last_only=True).logits[:, -1]
            elif cache is None or cache[0].n == window:
                keep = window if cache is None else window - window // 4
                cache = self.new_cache(idx.size(0))
                logits = self.decode(idx[:, -keep:], cache)
            else:
                logits = self.decode(idx[:, -1:], cache)
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            idx = torch.cat([idx, nxt], dim=1)
            yield nxt

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """idx (B, T) followed by max_new_tokens sampled tokens; `sampling` as in generate_stream."""
        new = list(self.generate_stream(idx, max_new_tokens, **sampling))
        return torch.cat([idx, *new], dim=1)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from logits (B, vocab): greedy at temperature 0, else softmax(logits / T)
    restricted to the k likeliest tokens and to the smallest set whose probability reaches top_p."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # tokens after the nucleus (the first always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> GPT:
    """Build on `device`; on "meta" nothing is allocated (for counting and FSDP init of big models)."""
    with torch.device(device):
        return GPT(cfg)


@dataclass
class ParamCounts:
    total: int  # distinct parameters (tied weights counted once)
    non_embedding: int  # without token embedding and output head

    def __str__(self) -> str:
        return f"{self.total:,} parameters ({self.non_embedding:,} non-embedding)"


def count_parameters(cfg_or_model: ModelConfig | nn.Module) -> ParamCounts:
    """Exact counts; a config is built on the meta device, so any size is free to count."""
    model = build_model(cfg_or_model, "meta") if isinstance(cfg_or_model, ModelConfig) else cfg_or_model
    total = sum(p.numel() for p in model.parameters())  # .parameters() already dedups tied weights
    emb = model.tok_emb.weight.numel()
    head = 0 if model.head.weight is model.tok_emb.weight else model.head.weight.numel()
    return ParamCounts(total, total - emb - head)
