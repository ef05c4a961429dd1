"""The configuration of a GPT trained with `pretrain`, for Hugging Face transformers.

`pretrain export --format hf` writes it beside the weights, with modeling_pretrain_gpt.py, for every
model that a plain LlamaForCausalLM cannot express: the model switches (ReLU squared MLP, QK-norm and an
attention scale, norms without gains, the embedding norm, soft-capped logits, value embeddings, the x0 and
U-net skips) and looped models, whose recurrent blocks share their weights and run several times. It
imports only transformers, so a folder loads anywhere with `trust_remote_code=True`.

The block structure is explicit rather than derived: `block_order` lists the distinct block each layer
runs, so a looped model's recurrent blocks appear once per loop and every run has its own layer index
(its own slot in the KV cache); `num_hidden_layers` is its length.
"""

from transformers import PretrainedConfig


class PretrainGPTConfig(PretrainedConfig):
    model_type = "pretrain_gpt"

    def __init__(
        self,
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_attention_heads=4,
        num_key_value_heads=None,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        mlp="swiglu",
        qk_norm=False,
        attn_scale=None,
        parameter_free_norms=False,
        embed_norm=False,
        final_logit_softcapping=None,
        x0_skip=False,
        num_value_embeds=0,
        value_embed_tables=None,
        unet_skip_pairs=None,
        block_order=None,
        num_hidden_layers=None,
        tie_word_embeddings=False,
        use_cache=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # the MLP's hidden width
        self.num_attention_heads = num_attention_heads
        # fewer key/value heads than query heads: grouped-query attention
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings  # the context the model was trained on
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.mlp = mlp  # swiglu (SiLU-gated, three matrices) | relu2 (ReLU squared, two)
        self.qk_norm = qk_norm  # RMS-normalize each head's queries and keys (no gain) before RoPE
        self.attn_scale = attn_scale  # attention logit scale; None = 1/sqrt(head_dim)
        self.parameter_free_norms = parameter_free_norms  # RMSNorms without a learned gain
        self.embed_norm = embed_norm  # RMS-normalize the token embedding before the first block
        # logits -> cap * tanh(logits / cap); None = off (the name vLLM reads)
        self.final_logit_softcapping = final_logit_softcapping
        self.x0_skip = x0_skip  # each block mixes the (normalized) embedding into its input
        self.num_value_embeds = num_value_embeds  # token tables mixed into the attention values
        # the distinct block each layer runs: a looped model's recurrent blocks appear once per loop
        self.block_order = block_order if block_order is not None else list(range(num_hidden_layers or 4))
        blocks = max(self.block_order) + 1
        # per distinct block: the value-embedding table it reads, or None
        self.value_embed_tables = value_embed_tables if value_embed_tables is not None else [None] * blocks
        self.unet_skip_pairs = unet_skip_pairs or []  # [early block, late block]: late adds early's output
        self.num_hidden_layers = len(self.block_order)  # layers run per forward pass: the KV cache's slots
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = use_cache
        super().__init__(**kwargs)
