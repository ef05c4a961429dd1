"""The model's sections: the GPT's sizes, attention, initialisation and switches (`model:`), and the
looped variant (`model.loop:`); read by app/trainer/model/gpt.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class LoopConfig:
    """Looped transformer: prelude blocks, recurrent blocks run `recurrence` times with shared weights,
    coda."""

    prelude: int = 0  # blocks run once before the recurrent ones
    recurrent: int = 0  # blocks run `recurrence` times with shared weights; 0 = plain GPT (n_layer blocks)
    coda: int = 0  # blocks run once after the recurrent ones
    recurrence: int = 1  # how many times the recurrent blocks run per forward pass
    deep_supervision: bool = False  # a loss at the output of every recurrence
    # the weight of each recurrence's loss under deep supervision; given, supervision_weight_base is unused
    loss_weights: list[float] = field(default_factory=list)
    supervision_weight_base: float = 1.0  # loop i weighs base^i (normalised); 1 = equal (docs/recipes.md)
    improvement_reward_scale: float = 0.0  # reward each read-out's relative gain over the previous one


@dataclass
class ModelConfig:
    """The GPT: sizes, attention and initialisation (app/trainer/model/gpt.py)."""

    vocab_size: int = 0  # tokens in the vocabulary; 0 = take it from the tokenizer of the data
    vocab_multiple: int = 128  # embedding/head rows padded to a multiple of this (fast head matmul); 1 = off
    seq_len: int = 256  # tokens per training sequence (the context length)
    n_layer: int = 4  # transformer blocks (plain GPT)
    d_model: int = 256  # width of the residual stream
    n_head: int = 4  # attention heads; must divide d_model
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0 = n_head (plain multi-head attention)
    # MLP hidden width; 0 = 8/3 * d_model rounded up to a multiple of 64 (SwiGLU), 4 * d_model (relu2)
    d_ff: int = 0
    rope_base: float = 10000.0  # RoPE base frequency; above 1 (its frequencies fall with the dimension)
    tie_embeddings: bool = True  # the output head shares the token embedding's weights
    norm_eps: float = 1e-5  # RMSNorm epsilon, in (0, 1): it guards a division by zero
    init_std: float = 0.02  # standard deviation of the normal initialisation of the weights; > 0
    # Switches from the open record (modded-nanogpt) and nanochat, all off by default: docs/recipes.md

    mlp: str = "swiglu"  # the MLP: swiglu | relu2 (ReLU squared, two matrices; d_ff 0 = 4 * d_model)
    qk_norm: bool = False  # RMS-normalize each head's queries and keys (no gain) before RoPE
    attn_scale: float = 0.0  # attention logit scale; 0 = 1/sqrt(head dim)
    parameter_free_norms: bool = False  # RMSNorms without a learned gain
    embed_norm: bool = False  # RMS-normalize the token embedding (no gain) before the first block
    zero_init: bool = False  # start attn.wo, mlp.w_down and an untied head at zero
    # logits -> cap * tanh(logits / cap) (the record: 15); 0 = off; at least 1, under which the model cannot
    # learn (no token could be more than e^(2 cap) times likelier than another)
    logit_softcap: float = 0.0
    value_embeds: int = 0  # N token tables mixed into the attention values of the first and last N blocks
    x0_skip: bool = False  # each block mixes the (normalized) embedding into its input, learned weights
    unet_skips: bool = False  # late blocks add the output of their mirror early block, learned weights
    loop: LoopConfig = field(default_factory=LoopConfig)

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn_dim(self) -> int:
        if self.mlp == "relu2":
            return self.d_ff or 4 * self.d_model
        return self.d_ff or 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def mlp_matrices(self) -> int:
        """d_model x ffn_dim matrices in one MLP: SwiGLU's gate, up and down; ReLU squared's up and down."""
        return 2 if self.mlp == "relu2" else 3

    @property
    def value_embed_tables(self) -> list[int | None]:
        """Per distinct block, the value-embedding table it reads (None: none). N tables serve the first N
        blocks and, in the same order, the last N (the record's 012...012 pattern)."""
        n, k = self.n_blocks, self.value_embeds
        return [i if i < k else i - (n - k) if i >= n - k else None for i in range(n)]

    @property
    def skip_pairs(self) -> list[tuple[int, int]]:
        """U-net skips as (early block, late block): mirrored around the middle of a plain model, around the
        recurrent core of a looped one (prelude outputs into the coda); the late block adds the early one's
        output to its input."""
        if not self.unet_skips:
            return []
        if self.looped:
            first_late, pairs = (
                self.loop.prelude + self.loop.recurrent,
                min(self.loop.prelude, self.loop.coda),
            )
            return [(self.loop.prelude - 1 - i, first_late + i) for i in range(pairs)]
        pairs = self.n_layer // 2
        return [(pairs - 1 - i, self.n_layer - pairs + i) for i in range(pairs)]

    @property
    def looped(self) -> bool:
        return self.loop.recurrent > 0

    @property
    def n_blocks(self) -> int:
        """Distinct blocks with their own weights."""
        lp = self.loop
        return lp.prelude + lp.recurrent + lp.coda if self.looped else self.n_layer

    @property
    def effective_depth(self) -> int:
        """Blocks run per forward pass (recurrent ones count once per recurrence)."""
        lp = self.loop
        return lp.prelude + lp.recurrent * lp.recurrence + lp.coda if self.looped else self.n_layer
