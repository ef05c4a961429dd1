"""`validate(cfg)`: every config error as one line that names the key and how to fix it (exit 2).

Kept apart from app/config.py so the schema reads on its own; the checks here are tables where they can be.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from app.budget.config import check_shared_keys
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
    "model.rope_base",
    "budget.poll_seconds",
    "model.vocab_multiple",
    "train.mfu_floor_minutes",
]
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
    "optim.fused": ("auto", "true", "false"),
    "checkpoint.verify": ("sha256", "size"),
    "data.tokenizer": ("bpe", "char"),
    "metrics.wandb_mode": ("", "online", "offline", "disabled"),
}


def _get(cfg: Config, key: str):
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
    m, t, o, s, c, b = cfg.model, cfg.train, cfg.optim, cfg.schedule, cfg.checkpoint, cfg.budget
    t.compile, o.fused, t.fp8 = _switch(t.compile), _switch(o.fused), _switch(str(t.fp8))
    b.kube = {"true": "on", "false": "off"}.get(_switch(b.kube), _switch(b.kube))
    for key in POSITIVE:
        _check(_get(cfg, key) > 0, f"{key} must be > 0, got {_get(cfg, key)}")
    for key, value in _numbers(cfg):
        _check(0 <= value < 2**53, f"{key} must be >= 0 and below 2**53, got {value}")
    if t.micro_batch_size == "auto":
        _check(
            t.batch_tokens > 0,
            "train.micro_batch_size=auto keeps the global batch: set train.batch_tokens "
            "(tokens per optimizer step), or give train.micro_batch_size a number",
        )
    else:
        _check(
            t.micro_batch_size > 0, f"train.micro_batch_size must be > 0 or auto, got {t.micro_batch_size}"
        )
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
    _check(
        2 * m.value_embeds <= m.n_blocks,
        f"model.value_embeds={m.value_embeds} needs {2 * m.value_embeds} blocks (the first and the last "
        f"{m.value_embeds}) and the model has {m.n_blocks}; use at most {m.n_blocks // 2}",
    )
    _check(
        not m.unet_skips or m.skip_pairs,
        "model.unet_skips needs blocks to pair: at least 2 layers, or a looped model with a prelude and a coda",
    )
    head_dim = m.d_model // m.n_head
    _check(head_dim % 2 == 0, f"head dim d_model/n_head = {head_dim} must be even for RoPE")
    _check(
        o.lr > 0, f"optim.lr must be > 0, got {o.lr} (the schedule scales every group by lr_at / optim.lr)"
    )
    _check(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    _check(0 <= o.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    for key in ("muon_momentum_start", "muon_momentum_end"):
        _check(0 <= getattr(o, key) < 1, f"optim.{key} must be in [0, 1), got {getattr(o, key)}")
    _check(
        m.loop.supervision_weight_base > 0,
        f"model.loop.supervision_weight_base must be > 0, got {m.loop.supervision_weight_base} (1 = equal weights)",
    )
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _check(0 < s.decay_fraction <= 1, f"schedule.decay_fraction must be in (0, 1], got {s.decay_fraction}")
    check_shared_keys(b)
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
    _check(t.collective_timeout_minutes <= 525600, "train.collective_timeout_minutes must be at most a year")
    _check(t.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {t.max_bad_steps}")
    _check(t.mfu_floor < 1, f"train.mfu_floor is a fraction of peak (e.g. 0.3), got {t.mfu_floor}")
    _check(
        cfg.metrics.port < 65536,
        f"metrics.port must be a TCP port (1-65535) or 0 for off, got {cfg.metrics.port}",
    )
