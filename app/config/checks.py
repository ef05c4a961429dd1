"""`validate(cfg)`: every config error as one line that names the key and how to fix it (exit 2).

Kept apart from the sections' dataclasses so the schema reads on its own; the checks here are tables where
they can be.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from app.config.budget import check_shared_keys
from app.config.root import Config
from app.errors import ConfigError
from app.gpus import normalize, with_memory


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _one_of(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{key}='{value}' is not valid; choose one of: {', '.join(choices)}")


def _switch(value: str) -> str:
    """An auto|true|false key as YAML may give it (`--set train.compile=true` parses as a bool)."""
    value = value.lower()
    aliases = {"yes": "true", "no": "false", "1": "true", "0": "false", "on": "true", "off": "false"}
    return aliases.get(value, value)


# Every number is >= 0 and below 2**53 (so JSON, numpy seeds and int64 tensors hold it);
# these must be > 0. Sizes that would not fit the machine are refused at start (memory.plan_for_training).
POSITIVE = [
    "model.d_model",
    "model.n_head",
    "model.seq_len",
    "train.max_steps",
    "checkpoint.lease_stale_seconds",
    "train.collective_timeout_minutes",
    "train.log_every",
    "train.eval_batches",
    "model.norm_eps",
    "budget.poll_seconds",
    "model.vocab_multiple",
    "train.mfu_floor_minutes",
]
# A soft-cap c keeps every logit inside (-c, c): no token can be more than e^(2c) times likelier than any other,
# so none's probability exceeds 1 / (1 + (V - 1) e^(-2c)) and the loss cannot fall under ln(1 + (V - 1) e^(-2c))
# per token. Below c = 1 that floor is above 1.65 nats for every vocabulary of 32 tokens or more (a small
# character-level model of Shakespeare reaches about 1.5) and, for GPT-2's 50257 tokens, 8.8 of ln V = 10.8:
# nothing useful can be learned (at 1e-30 the loss stays at ln V). The record and nanochat use 15.
LOGIT_SOFTCAP_MIN = 1.0
CHOICES = {
    "optim.name": ("adamw", "muon"),
    "model.mlp": ("swiglu", "relu2"),
    "optim.muon_lr_adjust": ("match_rms_adamw", "original"),
    "schedule.name": ("cosine", "wsd", "constant"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "train.parallel": ("ddp", "fsdp", "auto"),
    "train.compile": ("auto", "true", "false"),
    "train.fp8": ("false", "true", "emulate"),
    "train.compile_mode": ("default", "max-autotune", "max-autotune-no-cudagraphs"),
    "train.compile_backend": ("inductor", "aot_eager"),
    "train.activation_dtype": ("auto", "fp32", "bf16"),
    "train.fused_projections": ("auto", "true", "false"),
    "optim.fused": ("auto", "true", "false"),
    "checkpoint.verify": ("sha256", "size"),
    "data.tokenizer": ("bpe", "char"),
    "metrics.wandb_mode": ("", "online", "offline", "disabled"),
}


def get_key(cfg: Config, key: str):
    """The value of a dotted key ("optim.lr") in a config."""
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _numbers(obj: Any, prefix: str = ""):
    """(dotted key, value) of every numeric field of the config, nested sections included."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, f"{prefix}{f.name}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{prefix}{f.name}", value


def validate(cfg: Config) -> None:
    model = cfg.model
    train = cfg.train
    optim = cfg.optim
    train.compile = _switch(train.compile)
    train.fused_projections = _switch(str(train.fused_projections))
    train.fp8 = _switch(str(train.fp8))
    optim.fused = _switch(optim.fused)
    kube = _switch(cfg.budget.kube)
    cfg.budget.kube = {"true": "on", "false": "off"}.get(kube, kube)
    for key in POSITIVE:
        _check(get_key(cfg, key) > 0, f"{key} must be > 0, got {get_key(cfg, key)}")
    for key, value in _numbers(cfg):
        _check(0 <= value < 2**53, f"{key} must be >= 0 and below 2**53, got {value}")
    if train.micro_batch_size == "auto":
        _check(
            train.batch_tokens > 0,
            "train.micro_batch_size=auto keeps the global batch: set train.batch_tokens "
            "(tokens per optimizer step), or give train.micro_batch_size a number",
        )
    else:
        _check(
            train.micro_batch_size > 0,
            f"train.micro_batch_size must be > 0 or auto, got {train.micro_batch_size}",
        )
    for key, choices in CHOICES.items():
        _one_of(get_key(cfg, key), key, choices)
    if model.looped:
        loop = model.loop
        _check(loop.recurrence >= 1, f"model.loop.recurrence must be >= 1, got {loop.recurrence}")
        _check(loop.prelude >= 0 and loop.coda >= 0, "model.loop.prelude and model.loop.coda must be >= 0")
        _check(
            not loop.loss_weights or len(loop.loss_weights) == loop.recurrence,
            f"model.loop.loss_weights has {len(loop.loss_weights)} entries but model.loop.recurrence is "
            f"{loop.recurrence}; give one weight per recurrence",
        )
    else:
        _check(model.n_layer > 0, f"model.n_layer must be > 0, got {model.n_layer}")
        _check(
            not model.loop.deep_supervision,
            "model.loop.deep_supervision needs a looped model; set model.loop.recurrent > 0",
        )
    _check(
        model.d_model % model.n_head == 0,
        f"model.n_head={model.n_head} does not divide model.d_model={model.d_model}; "
        f"pick a divisor of {model.d_model}",
    )
    _check(
        model.n_head % model.kv_heads == 0,
        f"model.n_kv_head={model.kv_heads} does not divide model.n_head={model.n_head}; "
        f"pick a divisor of {model.n_head}",
    )
    _check(
        2 * model.value_embeds <= model.n_blocks,
        f"model.value_embeds={model.value_embeds} needs {2 * model.value_embeds} blocks (the first and the "
        f"last {model.value_embeds}) and the model has {model.n_blocks}; use at most {model.n_blocks // 2}",
    )
    _check(
        not model.unet_skips or model.skip_pairs,
        "model.unet_skips needs blocks to pair: at least 2 layers, or a looped model with a prelude and a "
        "coda",
    )
    head_dim = model.d_model // model.n_head
    _check(head_dim % 2 == 0, f"head dim d_model/n_head = {head_dim} must be even for RoPE")
    _check(
        optim.lr > 0,
        f"optim.lr must be > 0, got {optim.lr} (the schedule scales every group by lr_at / optim.lr)",
    )
    _check(
        0 <= optim.min_lr <= optim.lr,
        f"optim.min_lr={optim.min_lr} must be between 0 and optim.lr={optim.lr}",
    )
    _check(0 <= optim.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {optim.muon_momentum}")
    for key in ("muon_momentum_start", "muon_momentum_end"):
        value = getattr(optim, key)
        _check(0 <= value < 1, f"optim.{key} must be in [0, 1), got {value}")
    _check(
        model.loop.supervision_weight_base > 0,
        f"model.loop.supervision_weight_base must be > 0, got {model.loop.supervision_weight_base} "
        "(1 = equal weights)",
    )
    _check(0 <= optim.beta1 < 1 and 0 <= optim.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _check(
        0 < cfg.schedule.decay_fraction <= 1,
        f"schedule.decay_fraction must be in (0, 1], got {cfg.schedule.decay_fraction}",
    )
    check_shared_keys(cfg.budget)
    for name in cfg.metrics.trackers:
        _one_of(name, "metrics.trackers", ("tensorboard", "mlflow", "wandb"))
    _check(
        len(set(cfg.metrics.trackers)) == len(cfg.metrics.trackers), "metrics.trackers lists a tracker twice"
    )
    _check(
        cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}"
    )
    _check(
        cfg.data.vocab_size >= 260 or cfg.data.tokenizer == "char",
        f"data.vocab_size={cfg.data.vocab_size} is too small for a byte-level BPE; use >= 260",
    )
    _check(0 < cfg.data.val_fraction < 0.5, "data.val_fraction must be in (0, 0.5)")
    _check(train.spike_factor > 1, f"train.spike_factor must be > 1, got {train.spike_factor}")
    _check(
        train.collective_timeout_minutes <= 525600, "train.collective_timeout_minutes must be at most a year"
    )
    _check(train.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {train.max_bad_steps}")
    _check(train.mfu_floor < 1, f"train.mfu_floor is a fraction of peak (e.g. 0.3), got {train.mfu_floor}")
    _check(
        cfg.metrics.port < 65536,
        f"metrics.port must be a TCP port (1-65535) or 0 for off, got {cfg.metrics.port}",
    )
    if cfg.plan.gpu_type:  # the planning commands size the batch for it: its memory must be known
        types = with_memory()
        _check(
            normalize(cfg.plan.gpu_type) in types,
            f"plan.gpu_type='{cfg.plan.gpu_type}' is not a GPU type whose memory is known; use one of: "
            f"{', '.join(types)}",
        )
    _check_trainable(cfg)


def _check_trainable(cfg: Config) -> None:
    """Numbers that would be accepted and leave the model nothing to learn (tried with tiny's recipe at a small
    size for 80 steps: the loss stays at or near ln V, or turns NaN), each bounded where no recipe goes. Odd values that still
    train are left alone: a warm-up longer than the run (every short run has one, and a run may be
    extended), an attention scale or an init_std far from the usual, a tiny positive LR, model.seq_len=1
    (a bigram model)."""
    model = cfg.model
    optim = cfg.optim
    cap = model.logit_softcap
    _check(
        cap == 0 or cap >= LOGIT_SOFTCAP_MIN,
        f"model.logit_softcap={cap:g} is below {LOGIT_SOFTCAP_MIN:g}, where the model cannot learn: logits "
        "within (-cap, cap) make no token more than e^(2 x cap) times likelier than another; use a cap >= "
        f"{LOGIT_SOFTCAP_MIN:g} (the record uses 15), or 0 for none",
    )
    # all-zero weights: every matrix's gradient is zero too, so nothing ever moves
    _check(model.init_std > 0, "model.init_std must be > 0 (0 makes every weight and gradient zero), got 0")
    # RoPE's frequencies base^(-2i/d) fall with the dimension only for a base above 1: at 1 every pair of
    # dimensions rotates alike, below it the order inverts, and under float32's range (1e-38) the tables are NaN
    _check(
        model.rope_base > 1,
        f"model.rope_base={model.rope_base:g} must be > 1 (RoPE's frequencies fall with the dimension only "
        "above 1; 10000 is usual)",
    )
    # an epsilon guards a division by a mean square that is about 1 (a normalised stream) or init_std^2; at 1
    # or more it outweighs it, the norm stops normalising and from about 1e3 the loss stays at ln V
    _check(
        model.norm_eps < 1,
        f"model.norm_eps={model.norm_eps:g} must be below 1 (it guards a division by zero; 1e-5 is usual)",
    )
    # AdamW divides by sqrt(v) + eps: 0 gives 0/0 for a weight with no gradient yet (an unused embedding row),
    # and an eps of 1 or more outweighs every gradient, leaving updates of lr x gradient (SGD far too slow)
    _check(
        0 < optim.eps < 1,
        f"optim.eps={optim.eps:g} must be in (0, 1): 0 turns an unused weight into NaN, 1 or more stalls "
        "AdamW; 1e-8 is usual",
    )
    # the clipped gradient is no larger than grad_clip: at or under AdamW's eps every element's update is a
    # sliver of the LR (at 1e-8 the loss stays near ln V; at 1e-6, with eps 1e-8, it trains)
    _check(
        optim.grad_clip == 0 or optim.grad_clip > optim.eps,
        f"optim.grad_clip={optim.grad_clip:g} is not above optim.eps={optim.eps:g}: a gradient clipped that "
        "small stalls AdamW; use 0 for no clipping, or a clip such as 1.0",
    )
    # decoupled weight decay multiplies the decayed weights (the matrices, an untied head) by
    # 1 - lr x weight_decay each step, under Muon too
    decayed = {"optim.matrix_lr" if optim.matrix_lr else "optim.lr": optim.matrix_lr or optim.lr}
    if not model.tie_embeddings:
        decayed["optim.head_lr" if optim.head_lr else "optim.lr"] = optim.head_lr or optim.lr
    key, peak = max(decayed.items(), key=lambda item: item[1])
    product = peak * optim.weight_decay
    _check(
        product < 1,
        f"{key}={peak:g} x optim.weight_decay={optim.weight_decay:g} = {product:g}: weight decay multiplies the "
        f"weights by 1 - {product:g} each step, erasing or flipping them; lower the LR (a typo?) or the weight "
        "decay until their product is under 1",
    )
