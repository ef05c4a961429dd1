"""One source for every setting's help: the comment of its config dataclass field, on the lines right above
the field or at its end, read once from the source (as tyro reads field docstrings for torchtitan's
config manager). The `pretrain train` / `watch` / `prepare` flags that set a field take their help from it
(app/config/flags.py generates them), docs/config.md is generated from it (`python -m app.config.docs >
docs/config.md`), and a test checks the chart's `## @param` lines for the values that become config keys
against it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import sys
import textwrap
import tokenize
import typing


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """{field name: its help} of a dataclass, from the comments in its source ("" where there is none)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line -> the comment's text
    code_lines: set[int] = set()  # lines with code on them
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    (body,) = ast.parse(source).body
    helps = {}
    for node in body.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:  # a block of comment lines right above
            above.insert(0, comments[line])
            line -= 1
        after = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        helps[node.target.id] = " ".join(above + after)
    return helps


def sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted prefix, dataclass) of a config and every section nested in it, in field order."""
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            out += sections(hints[field.name], f"{prefix}{field.name}.")
    return out


def help_for(key: str, root: type | None = None) -> str:
    """The help of a dotted config key (`budget.cap_usd`); `root` defaults to app.config.Config."""
    if root is None:
        from app.config.root import Config

        root = Config
    cls = root
    *path, name = key.split(".")
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    return field_help(cls)[name]


def markdown() -> str:
    """docs/config.md: every config key with its default and help, section by section."""
    from app.config.checks import get_key
    from app.config.root import Config

    lines = [
        "# Config reference",
        "",
        "Every key of the `pretrain train` config, generated from the comments of the dataclasses in",
        "`app/config/` (`python -m app.config.docs > docs/config.md`; a test checks it is current).",
        "`pretrain train --print-config` prints the resolved config.",
        "",
        "## How a config resolves",
        "",
        "Later wins: the dataclass defaults < the preset (`--preset NAME`, or a config file's `preset:`;",
        "default `tiny`) < `--config FILE.yaml` < `--set section.key=value` < the flags that set one key",
        "(`--max-steps`, `--budget-cap-usd`, ...). The preset is never chosen with `--set` (a preset's values",
        "are applied before `--set`).",
        "",
        "## Presets",
        "",
        "A preset is a YAML file of config keys in `app/presets/`. It may name a base: `base: tiny` applies",
        "tiny first, then the preset's own keys, key by key in every section (a list is replaced whole). A",
        "base may name a base of its own; a base that is no preset of its own lives in a folder",
        "(`base: recipes/speedrun`: the speedrun recipe's model switches, Muon and WSD, without a model size).",
        "An unknown base, and bases that come back round to a preset they passed, are refused in one line",
        "(exit 2). So a preset reads as its differences: `tiny-speedrun` is `tiny` with a shorter run.",
        "",
        "A preset may name the GPUs it is made for in `plan:` (`char-d64`: 8 of `h100-sxm`). Told no GPUs",
        "(no `--gpus`, `--gpu-type` or torchrun), `--print-config` plans for them as `--gpus 8 --gpu-type",
        "h100-sxm` would, and `pretrain plan --preset` marks their row; a run trains on the GPUs it is",
        "launched on.",
        "",
    ]
    defaults = Config()
    for prefix, cls in sections(Config)[1:]:
        section = prefix.rstrip(".")
        lines += [f"## `{section}`", ""]
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
            lines += [" ".join(cls.__doc__.split()), ""]
        lines += ["| key | default | what it does |", "|---|---|---|"]
        hints = typing.get_type_hints(cls)
        helps = field_help(cls)
        for field in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[field.name]):
                continue
            value = get_key(defaults, f"{prefix}{field.name}")
            shown = f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'
            text = helps[field.name].replace("|", "\\|")
            lines.append(f"| `{prefix}{field.name}` | {shown} | {text} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
