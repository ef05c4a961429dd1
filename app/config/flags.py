"""Command-line flags generated from config dataclass fields, as torchtitan's config manager generates its
command line from its dataclasses. Each flag is declared once, as a `Flag` naming its field, and takes its
type, default, choices and help (the field's comment: app/config/docs.py) from that field. `pretrain
train`, `pretrain watch` and `pretrain prepare` build their field flags here; a `Flag` only says what the
CLI's stable names (docs/contracts.md) need beyond the field: the flag's name, its metavar, a parser for
counts such as 50M.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config.docs import field_help


@dataclass(frozen=True)
class Flag:
    """How one dataclass field is set on the command line; everything else comes from the field."""

    field: str  # the field's name; dotted below the root dataclass ("train.max_steps")
    name: str = ""  # the flag; "" = --field-name (its underscores as dashes)
    metavar: str | None = None  # the value's name in --help; None = argparse's (the flag in capitals)
    parse: Callable[[str], Any] | None = None  # reads the value; None = the field's type
    choices: tuple[str, ...] | None = None  # the values accepted; None = any
    # not given = None (the config file, or a rule of the command, decides), not the field's default
    unset: bool = False
    dest_name: str = ""  # the attribute the value is parsed into; "" = argparse's, from the flag

    @property
    def flag(self) -> str:
        return self.name or "--" + self.field.rsplit(".", 1)[-1].replace("_", "-")

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value in: --max-steps -> max_steps."""
        return self.dest_name or self.flag.removeprefix("--").replace("-", "_")


def owner_of(root: type, key: str) -> tuple[type, str]:
    """(the dataclass that holds a dotted key's field, the field's name)."""
    cls = root
    *path, name = key.split(".")
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    return cls, name


def shown(value: Any) -> Any:
    """A default as the help shows it: 50M for 50,000,000."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**6 and value % 10**6 == 0:
        return f"{value // 10**6}M"
    return value


def flag_help(text: str, default: Any = None) -> str:
    """A field's help as argparse shows it (its % escaped), with the default where one says something."""
    said = "" if default in (None, "", 0, 0.0, False, []) else f" (default: {shown(default)})"
    return text.replace("%", "%%") + said


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _value_type(kind: Any) -> Any:
    """The type one value on the command line has: X of `X | None`, str for a path (the command makes it
    one)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return str if kind is Path else kind


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    root: type,
    spec: Flag,
    show_default: bool = True,
    show_key: bool = False,
) -> None:
    """Add `spec`'s flag: a bool field is a switch (--x, or --x/--no-x when it defaults to true), a list
    field a repeatable flag, a field without a default a required flag (unless `spec.unset`). The help is
    the field's comment, with its default (`show_default`) or its dotted key (`show_key`) after it."""
    cls, name = owner_of(root, spec.field)
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    kind = typing.get_type_hints(cls)[name]
    default = _default(field)
    text = flag_help(
        field_help(cls)[name], default if show_default and default is not dataclasses.MISSING else None
    )
    if show_key:
        text += f" ({spec.field})"
    options: dict[str, Any] = {"dest": spec.dest, "help": text}
    if spec.metavar:
        options["metavar"] = spec.metavar
    if kind is bool:
        on = default is True and not spec.unset
        options["action"] = argparse.BooleanOptionalAction if on else "store_true"
        options["default"] = None if spec.unset else default
        parser.add_argument(spec.flag, **options)
        return
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        options["action"] = "append"
        kind = item
    options["type"] = spec.parse or _value_type(kind)
    if spec.choices:
        options["choices"] = spec.choices
    if spec.unset:
        options["default"] = None
    elif default is dataclasses.MISSING:
        options["required"] = True
    else:
        options["default"] = default
    parser.add_argument(spec.flag, **options)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    root: type,
    specs: typing.Iterable[Flag],
    show_default: bool = True,
    show_key: bool = False,
) -> None:
    for spec in specs:
        add_flag(parser, root, spec, show_default, show_key)


def given(args: argparse.Namespace, specs: typing.Iterable[Flag]) -> dict[str, Any]:
    """{field: value} of the flags in `specs` as parsed (None where an unset flag was not given)."""
    return {spec.field: getattr(args, spec.dest) for spec in specs}
