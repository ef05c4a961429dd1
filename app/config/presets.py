"""Presets: the YAML files in app/presets/ a run's config starts from, and reading any YAML config file.

A preset may name a base (`base: tiny`): the base is applied first and the preset's own keys override it,
key by key, in every section (a list is replaced whole); a base may name its own base. So a preset is
written as its differences: tiny-speedrun is tiny with a shorter run. app/presets/recipes/ holds bases
that are not presets of their own, such as the speedrun recipe's model switches without a model size
(`base: recipes/speedrun`); `--preset` lists and takes only the files directly in app/presets/.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from app.errors import ConfigError

PRESET_DIR = Path(__file__).parent.parent / "presets"
BASE_KEY = "base"
# a preset's name, or a base's path under app/presets/ (recipes/speedrun): no way out of the folder
NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)*")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def base_names() -> list[str]:
    """Every name a `base:` may give: the presets, then the bases under app/presets/'s folders."""
    nested = sorted(str(p.relative_to(PRESET_DIR).with_suffix("")) for p in PRESET_DIR.glob("*/**/*.yaml"))
    return preset_names() + nested


def load_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text; pass a YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{what} {path} is not valid YAML{at}; fix the syntax") from None
    if data is None:  # an empty file is almost always a mistake (wrong path, unsaved editor buffer)
        raise ConfigError(f"{what} {path} is empty; give it config keys or leave out --config")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of config keys")
    return data


def _closest(name: str, names: list[str]) -> str:
    """`did you mean 'tiny'? ` for a near miss, else ""."""
    close = [n for n in names if n.startswith(name)][:1] or difflib.get_close_matches(
        name, names, n=1, cutoff=0.5
    )
    return f"did you mean '{close[0]}'? " if close else ""


def preset_layers(name: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, keys) of a preset and each of its bases, the deepest base first: applied in this order, each
    one's keys override those before it. An unknown preset or base, a base chain that comes back to a
    preset it passed, and a `base:` that is not a name are refused in one line."""
    if name not in preset_names():
        names = preset_names()
        raise ConfigError(
            f"unknown preset '{name}'; {_closest(name, names)}choose one of: {', '.join(names)}"
        )
    layers: list[tuple[str, dict[str, Any]]] = []
    chain = [name]
    while True:
        data = load_yaml(PRESET_DIR / f"{chain[-1]}.yaml", "preset")
        layers.insert(0, (chain[-1], data))
        base = data.pop(BASE_KEY, None)
        if base is None:
            return layers
        where = f"preset {chain[-1]} ({PRESET_DIR.name}/{chain[-1]}.yaml)"
        names = base_names()
        if not isinstance(base, str) or not NAME.fullmatch(base):
            raise ConfigError(f"{where}: base must name a preset, e.g. `base: tiny`; got {base!r}")
        if base in chain:
            loop = " -> ".join([*chain, base])
            raise ConfigError(
                f"{where}: its bases go round in a circle ({loop}); remove one of these `base:` keys"
            )
        if base not in names:
            raise ConfigError(
                f"{where}: unknown base '{base}'; {_closest(base, names)}choose one of: {', '.join(names)}"
            )
        chain.append(base)
