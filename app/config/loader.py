"""Resolving a config: YAML presets, `--config FILE.yaml`, `--set a.b=c` overrides, then the checks.

Resolution order: dataclass defaults < preset YAML (its bases first: app/config/presets.py) < --config
FILE.yaml < --set overrides < flags.
Every error is a ConfigError with one line that names the key and how to fix it. Keys that moved are
listed in MOVED.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from app.config.checks import validate
from app.config.presets import load_yaml, preset_layers
from app.config.root import DEFAULT_PRESET, Config
from app.errors import ConfigError


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key a user may set."""
    keys = []
    hints = typing.get_type_hints(cls)
    for field_ in dataclasses.fields(cls):
        kind = hints[field_.name]
        if dataclasses.is_dataclass(kind):
            keys += all_keys(kind, f"{prefix}{field_.name}.")
        else:
            keys.append(f"{prefix}{field_.name}")
    return keys


def suggest_key(key: str) -> str | None:
    """The valid key a user most likely meant: `train.lr` -> `optim.lr`, `model.n_layers` ->
    `model.n_layer`."""
    keys = all_keys()
    section, _, last = key.rpartition(".")
    same_last = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    if same_last:
        return same_last[0]
    in_section = [k for k in keys if k.rpartition(".")[0] == section]
    for pool in (in_section, keys):
        by_last = {k.rsplit(".", 1)[-1]: k for k in pool}
        match = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.75)
        if match:
            return by_last[match[0]]
    return None


def _coerce(value: Any, typ: Any, key: str, where: str) -> Any:
    bad = ConfigError(f"{key} in {where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise bad
    if typ in (int, float) and isinstance(value, bool):
        raise bad
    if typ is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                raise bad from None
        raise bad
    if typ is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(number):
            raise ConfigError(f"{key} in {where}: must be a finite number, got {value!r}")
        return number
    if typ is str:
        if isinstance(value, dict | list):  # `--set key.sub=x` under a string key, or a YAML list
            raise bad
        return "" if value is None else str(value)
    if typing.get_args(typ) == (int, str):  # a number or "auto"
        if str(value).lower() == "auto":
            return "auto"
        try:
            return _coerce(value, int, key, where)
        except ConfigError:
            raise ConfigError(f"{key} in {where}: expected a whole number or auto, got {value!r}") from None
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, item, key, where) for v in value]
    raise bad


# Keys that moved: a checkpoint's meta.json still has the old names (read as the new ones); a user's
# config, --set or preset is refused in one line that names the new key.
MOVED = {
    "train.inject_oom_above": "drill.oom_above",
    "train.inject_spike_at_step": "drill.spike_at_step",
    "train.spike_batches": "drill.spike_batches",
}
FROM_CHECKPOINT = "checkpoint meta.json"


def _move_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with every moved key under its new name (a copy), or ConfigError outside a checkpoint."""
    data = {section: dict(keys) if isinstance(keys, dict) else keys for section, keys in data.items()}
    for old, new in MOVED.items():
        old_section, old_key = old.split(".")
        keys = data.get(old_section)
        if not isinstance(keys, dict) or old_key not in keys:
            continue
        if where != FROM_CHECKPOINT:
            raise ConfigError(f"{old} in {where} is now {new}; set {new} instead")
        new_section, new_key = new.split(".")
        data.setdefault(new_section, {})[new_key] = keys.pop(old_key)
    return data


def merge_into(obj: Any, data: dict[str, Any], where: str, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at '{prefix.rstrip('.') or 'top level'}'")
    if not prefix and isinstance(obj, Config):
        data = _move_keys(data, where)
    hints = typing.get_type_hints(type(obj))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            close = suggest_key(dotted)
            hint = (
                f"; did you mean '{close}'?"
                if close
                else "; see `pretrain train --print-config` for valid keys"
            )
            raise ConfigError(f"unknown config key '{dotted}' in {where}{hint}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            merge_into(getattr(obj, key), value, where, f"{dotted}.")
        else:
            setattr(obj, key, _coerce(value, typ, dotted, where))


def _dotted_to_nested(key: str, value: Any) -> dict[str, Any]:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(
    preset: str | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Config:
    """Resolve and validate a config. `extra` holds dotted keys from dedicated CLI flags."""
    cfg = Config()
    file_data: dict[str, Any] = {}
    if config_file:
        file_data = load_yaml(Path(config_file), "config file")
    # a checkpoint's meta.json: the whole config its run trained with, not today's preset of that name
    if isinstance(file_data.get("config"), dict) and "step" in file_data:
        if preset:
            raise ConfigError(f"--config {config_file} is a checkpoint's whole config: leave out --preset")
        return apply_overrides(config_from_dict(file_data["config"]), overrides, extra)
    if "base" in file_data:
        raise ConfigError(
            f"config file {config_file}: `base:` is for presets (app/presets/); a config file names the preset "
            "it starts from with `preset: NAME`"
        )
    file_preset = file_data.pop("preset", None)
    cfg.preset = preset or file_preset or DEFAULT_PRESET
    for name, keys in preset_layers(cfg.preset):  # its bases first (app/config/presets.py)
        merge_into(cfg, keys, f"preset {name}")
    if file_data:
        merge_into(cfg, file_data, f"config file {config_file}")
    return apply_overrides(cfg, overrides, extra)


def apply_overrides(cfg: Config, overrides: list[str] | None, extra: dict[str, Any] | None) -> Config:
    """--set items, then the dedicated flags' keys; then validate."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. --set model.n_layer=8), got '{item}'")
        key, raw = item.split("=", 1)
        # a preset's values are applied before --set, so here its name would only relabel the run
        if key.strip().split(".")[0] == "preset":
            raise ConfigError(
                f"--set {item.strip()} would only relabel the run, not apply the preset's values: "
                f"choose the preset with --preset {raw.strip() or 'NAME'}"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        merge_into(cfg, _dotted_to_nested(key.strip(), value), "--set")
    for key, value in (extra or {}).items():
        if value is not None:
            merge_into(cfg, _dotted_to_nested(key, value), "command line")
    validate(cfg)
    return cfg


def vocab_for_estimates(cfg: Config) -> int:
    """model.vocab_size, or while the data is not known yet (--print-config, plans, `pretrain bench`):
    the embedded BPE's data.vocab_size, 128 for a char tokenizer."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    return cfg.data.vocab_size if cfg.data.tokenizer == "bpe" else 128


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a config saved in a checkpoint's meta.json."""
    cfg = Config()
    data = dict(data)
    cfg.preset = data.pop("preset", DEFAULT_PRESET)
    merge_into(cfg, data, FROM_CHECKPOINT)
    if "vocab_multiple" not in data.get("model", {}):
        cfg.model.vocab_multiple = 1  # written before vocabulary padding: its rows are the true vocab
    return cfg
