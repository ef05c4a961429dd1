"""A GPT trained with `pretrain`, for Hugging Face transformers, top to bottom.

`pretrain export --format hf` ships this file beside the weights for every model a plain
LlamaForCausalLM cannot express; load it with `trust_remote_code=True`. It imports only torch and
transformers, and computes what pretrain's own model computes, switch by switch:

    embed -> (embedding norm) -> layers -> norm -> head -> (soft-cap)

Each layer runs one block; a looped model runs its recurrent blocks once per loop (`config.block_order`),
and each run is a layer of its own in the KV cache, since it attends over other inputs. Besides its input a
block may be fed the embedding (x0 skip), a value embedding (a token table mixed into its attention
values) and, for a late block, the output of its mirror early block (U-net skip). A deep-supervised
looped model reads out after the last loop only, as pretrain's sampling and eval do.

Attention goes through transformers' attention interface (sdpa by default, eager, or a serving engine's
own kernel: vLLM's Transformers backend), with transformers' KV cache (`cache`, `past_key_values` in
older releases) and masks, so `generate` and batches with left padding work as for any model of the
library.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_pretrain_gpt import PretrainGPTConfig


class PretrainGPTRMSNorm(nn.Module):
    """Scale-only normalization; elementwise_affine=False: no learned gain (QK-norm, the embedding norm,
    parameter-free norms)."""

    def __init__(self, hidden_size, eps=1e-5, elementwise_affine=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).type_as(x)
        return y if self.weight is None else y * self.weight


def rotary_angles(position_ids, head_dim, base):
    """cos and sin of each position's angles, (batch, 1, seq, head_dim / 2): computed from the positions
    given, so a left-padded row or a cached decode step gets its tokens' own positions."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = position_ids[:, None, :, None].float() * inv_freq.to(position_ids.device)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate the first half of each head against the second half (transformers' rotate_half layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention written out (attn_implementation="eager"); the mask is additive."""
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class PretrainGPTAttention(nn.Module):
    """Causal self-attention with grouped key/value heads; optional QK-norm and value embedding."""

    def __init__(self, config, block_idx, value_embed):
        super().__init__()
        self.config = config
        self.layer_idx = block_idx  # the attention's own index (vLLM keys its cache by it)
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.attn_scale or 1.0 / math.sqrt(self.head_dim)
        self.is_causal = True
        hidden, kv = config.hidden_size, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv, bias=False)
        self.v_proj = nn.Linear(hidden, kv, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=False)
        self.qk_norm = (
            PretrainGPTRMSNorm(self.head_dim, config.rms_norm_eps, False) if config.qk_norm else None
        )
        # value embedding: v -> value_mix[0] * v + value_mix[1] * (this token's row of the block's table)
        self.value_mix = nn.Parameter(torch.full((2,), 0.5)) if value_embed else None

    def forward(self, x, rotary, attention_mask, cache, cache_idx, value_embed=None, **kwargs):
        batch, seq = x.shape[:2]
        shape = (batch, seq, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if self.value_mix is not None:
            mix = self.value_mix.to(v.dtype)
            v = mix[0] * v + mix[1] * value_embed.to(v.dtype).view(shape).transpose(1, 2)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:  # this run's keys and values join those of the earlier positions
            k, v = cache.update(k, v, cache_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        y, _ = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(y.reshape(batch, seq, -1))


class PretrainGPTSwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PretrainGPTReLU2(nn.Module):
    """relu(x W_up)^2 W_down: two matrices."""

    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class PretrainGPTBlock(nn.Module):
    """Pre-norm residual block; with the x0 skip its input is resid_scale * x + x0_scale * embedding."""

    def __init__(self, config, block_idx):
        super().__init__()
        gain = not config.parameter_free_norms
        eps = config.rms_norm_eps
        value_embed = config.value_embed_tables[block_idx] is not None
        self.input_layernorm = PretrainGPTRMSNorm(config.hidden_size, eps, gain)
        self.self_attn = PretrainGPTAttention(config, block_idx, value_embed)
        self.post_attention_layernorm = PretrainGPTRMSNorm(config.hidden_size, eps, gain)
        self.mlp = PretrainGPTReLU2(config) if config.mlp == "relu2" else PretrainGPTSwiGLU(config)
        self.resid_scale = nn.Parameter(torch.ones(1)) if config.x0_skip else None
        self.x0_scale = nn.Parameter(torch.zeros(1)) if config.x0_skip else None

    def forward(self, h, x0, value_embed, rotary, attention_mask, cache, cache_idx, **kwargs):
        if self.x0_scale is not None:
            h = self.resid_scale * h + self.x0_scale * x0
        attn = self.self_attn(
            self.input_layernorm(h), rotary, attention_mask, cache, cache_idx, value_embed, **kwargs
        )
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class PretrainGPTPreTrainedModel(PreTrainedModel):
    config_class = PretrainGPTConfig
    base_model_prefix = "model"
    _no_split_modules = ["PretrainGPTBlock"]
    _supports_sdpa = True
    _supports_attention_backend = True  # vLLM's Transformers backend plugs its attention in

    def _init_weights(self, module):
        """The library's init for linears, embeddings and norms; the switches' mixing weights start neutral
        (x0 off, U-net skips on, values and their table half each), as in pretrain."""
        super()._init_weights(module)
        if isinstance(module, PretrainGPTAttention) and module.value_mix is not None:
            nn.init.constant_(module.value_mix, 0.5)
        elif isinstance(module, PretrainGPTBlock) and module.x0_scale is not None:
            nn.init.ones_(module.resid_scale)
            nn.init.zeros_(module.x0_scale)
        elif isinstance(module, PretrainGPTModel) and module.skip_weights is not None:
            nn.init.ones_(module.skip_weights)


class PretrainGPTModel(PretrainGPTPreTrainedModel):
    """The stack up to the final norm: hidden states, which the causal LM's head reads."""

    def __init__(self, config):
        super().__init__(config)
        kv_dim = config.num_key_value_heads * config.head_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = (
            PretrainGPTRMSNorm(config.hidden_size, config.rms_norm_eps, False) if config.embed_norm else None
        )
        self.value_embeds = nn.ModuleList(
            nn.Embedding(config.vocab_size, kv_dim) for _ in range(config.num_value_embeds)
        )
        self.layers = nn.ModuleList(
            PretrainGPTBlock(config, i) for i in range(len(config.value_embed_tables))
        )
        # U-net skips: block `late` adds skip_weights[j] x the output of block `early`, for pair j
        self.skip_from = {late: (j, early) for j, (early, late) in enumerate(config.unet_skip_pairs)}
        self.skip_sources = {early for early, _ in config.unet_skip_pairs}
        self.skip_weights = (
            nn.Parameter(torch.ones(len(config.unet_skip_pairs))) if config.unet_skip_pairs else None
        )
        self.norm = PretrainGPTRMSNorm(
            config.hidden_size, config.rms_norm_eps, not config.parameter_free_norms
        )
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is None and self.value_embeds:
            raise ValueError("this model's value embeddings look up token ids: pass input_ids")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        x0 = h if self.config.x0_skip else None
        values = [table(input_ids) for table in self.value_embeds]

        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:  # the real tokens' positions: a left-padded row counts from its first token
            seq, past = h.shape[1], cache.get_seq_length() if cache is not None else 0
            if attention_mask is not None and attention_mask.dim() == 2:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq:]
            else:
                position_ids = torch.arange(past, past + seq, device=h.device)[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        rotary = rotary_angles(position_ids, self.config.head_dim, self.config.rope_theta)

        kept = {}  # early blocks' outputs, for the U-net skips
        for layer_idx, block_idx in enumerate(self.config.block_order):
            if block_idx in self.skip_from:
                j, early = self.skip_from[block_idx]
                h = h + self.skip_weights[j] * kept[early]
            table = self.config.value_embed_tables[block_idx]
            value_embed = None if table is None else values[table]
            h = self.layers[block_idx](h, x0, value_embed, rotary, mask, cache, layer_idx, **kwargs)
            if block_idx in self.skip_sources:
                kept[block_idx] = h
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), cache=cache if use_cache else None)


class PretrainGPTForCausalLM(PretrainGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = PretrainGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        h = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(h[:, keep, :])
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits.float() / cap)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
