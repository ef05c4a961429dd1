"""`validate(cfg)`: every config error as one line that names the key and how to fix it (exit 2).

Kept apart from app/config.py so the schema reads on its own; the checks here are tables where they can be.
"""

from __future__ import annotations

from typing import Any

from app.errors import ConfigError

Config = Any  # app.config.Config, which imports this module (so not imported back)


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


POSITIVE = ["model.d_model", "model.n_head", "model.seq_len", "train.micro_batch_size", "train.max_steps",
            "checkpoint.lease_stale_seconds", "train.collective_timeout_minutes"]  # fmt: skip
NON_NEGATIVE = [
    "model.vocab_size", "model.n_kv_head", "model.d_ff", "train.batch_tokens", "train.max_tokens",
    "train.max_hours", "train.eval_every", "train.prefetch", "schedule.warmup_steps", "checkpoint.every_steps",
    "checkpoint.every_minutes", "checkpoint.lease_wait_seconds", "optim.weight_decay", "optim.grad_clip",
    "optim.matrix_lr", "optim.embedding_lr", "optim.head_lr", "model.loop.improvement_reward_scale",
    "budget.cap_usd", "budget.price_per_gpu_hour", "budget.gpus", "budget.max_price_per_gpu_hour",
    "metrics.port",
]  # fmt: skip
CHOICES = {
    "optim.name": ("adamw", "muon"),
    "optim.muon_lr_adjust": ("match_rms_adamw", "original"),
    "schedule.name": ("cosine", "wsd", "constant"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "train.parallel": ("ddp", "fsdp", "auto"),
    "budget.kube": ("auto", "on", "off"),
    "train.compile": ("auto", "true", "false"),
    "train.compile_mode": ("default", "max-autotune", "max-autotune-no-cudagraphs"),
    "optim.fused": ("auto", "true", "false"),
    "checkpoint.verify": ("sha256", "size"),
    "data.tokenizer": ("bpe", "char"),
    "budget.source": ("static", "file", "opencost"),
    "metrics.wandb_mode": ("", "online", "offline", "disabled"),
}


def _get(cfg: Config, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    m, t, o, s, c, b = cfg.model, cfg.train, cfg.optim, cfg.schedule, cfg.checkpoint, cfg.budget
    t.compile, o.fused = _switch(t.compile), _switch(o.fused)
    b.kube = {"true": "on", "false": "off"}.get(_switch(b.kube), _switch(b.kube))
    for key in POSITIVE:
        _check(_get(cfg, key) > 0, f"{key} must be > 0, got {_get(cfg, key)}")
    for key in NON_NEGATIVE:
        _check(_get(cfg, key) >= 0, f"{key} must be >= 0, got {_get(cfg, key)}")
    for key, choices in CHOICES.items():
        _one_of(_get(cfg, key), key, choices)
    if m.looped:
        lp = m.loop
        _check(lp.recurrence >= 1, f"model.loop.recurrence must be >= 1, got {lp.recurrence}")
        _check(lp.prelude >= 0 and lp.coda >= 0, "model.loop.prelude and model.loop.coda must be >= 0")
        _check(
            not lp.loss_weights or len(lp.loss_weights) == lp.recurrence,
            f"model.loop.loss_weights has {len(lp.loss_weights)} entries but model.loop.recurrence is "
            f"{lp.recurrence}; give one weight per recurrence",
        )
    else:
        _check(m.n_layer > 0, f"model.n_layer must be > 0, got {m.n_layer}")
        _check(
            not m.loop.deep_supervision,
            "model.loop.deep_supervision needs a looped model; set model.loop.recurrent > 0",
        )
    _check(
        m.d_model % m.n_head == 0,
        f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; pick a divisor of {m.d_model}",
    )
    _check(
        m.n_head % m.kv_heads == 0,
        f"model.n_kv_head={m.kv_heads} does not divide model.n_head={m.n_head}; pick a divisor of {m.n_head}",
    )
    head_dim = m.d_model // m.n_head
    _check(head_dim % 2 == 0, f"head dim d_model/n_head = {head_dim} must be even for RoPE")
    _check(
        o.lr > 0, f"optim.lr must be > 0, got {o.lr} (the schedule scales every group by lr_at / optim.lr)"
    )
    _check(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    _check(0 <= o.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    _check(
        m.loop.supervision_weight_base > 0,
        f"model.loop.supervision_weight_base must be > 0, got {m.loop.supervision_weight_base} (1 = equal weights)",
    )
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _check(0 < s.decay_fraction <= 1, f"schedule.decay_fraction must be in (0, 1], got {s.decay_fraction}")
    _check(0 < b.decay_fraction < 1, f"budget.decay_fraction must be in (0, 1), got {b.decay_fraction}")
    _check(0 < b.alert_fraction <= 1, f"budget.alert_fraction must be in (0, 1], got {b.alert_fraction}")
    for name in cfg.metrics.trackers:
        _one_of(name, "metrics.trackers", ("tensorboard", "mlflow", "wandb"))
    _check(
        len(set(cfg.metrics.trackers)) == len(cfg.metrics.trackers), "metrics.trackers lists a tracker twice"
    )
    _check(c.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {c.keep_last}")
    _check(
        cfg.data.vocab_size >= 260 or cfg.data.tokenizer == "char",
        f"data.vocab_size={cfg.data.vocab_size} is too small for a byte-level BPE; use >= 260",
    )
    _check(0 < cfg.data.val_fraction < 0.5, "data.val_fraction must be in (0, 0.5)")
    _check(t.spike_factor > 1, f"train.spike_factor must be > 1, got {t.spike_factor}")
    _check(t.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {t.max_bad_steps}")
    _check(
        cfg.metrics.port < 65536,
        f"metrics.port must be a TCP port (1-65535) or 0 for off, got {cfg.metrics.port}",
    )
