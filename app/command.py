"""What every `pretrain` subcommand shares: a parser whose errors are one line, and the exit-code rule.

Exit codes: 0 done; 2 bad input, config or data (one line on stderr, no traceback); 130 Ctrl-C.
A file this user may not write (a root-owned volume, a read-only mount) is bad input too: one line
naming the path, the uid and the fix, exit 2.
"""

from __future__ import annotations

import argparse
import decimal
import os
import sys
from collections.abc import Callable

from app.errors import UserError, print_stderr
from app.files import NOT_WRITABLE, unwritable_message


class Parser(argparse.ArgumentParser):
    """argparse with bad flags reported like every other bad input: one line, exit 2."""

    def error(self, message: str) -> None:
        raise UserError(f"{self.prog}: {message} (see --help)")


# k, M, G and B (billion, as in "10B tokens"), T: decimal
COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}
MAX_COUNT = 10**18


def count(text: str) -> int:
    """A count flag's value (argparse type), read alike by every command: a whole number >= 0, with an
    optional decimal suffix k, M, G or B (billion), T: 50M = 50,000,000, 10B = 10^10, 1.5k = 1500. A B after
    another suffix is the unit byte: 256MB = 256M. Refused: fractions, negatives, inf, nan, over 10^18."""
    t = text.strip().replace("_", "").lower()
    if len(t) > 2 and t[-1] == "b" and t[-2] in "kmgt":
        t = t[:-1]
    scale = COUNT_SUFFIXES.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = decimal.Decimal(t) * scale
    except decimal.InvalidOperation:
        value = decimal.Decimal("nan")
    if not (value.is_finite() and 0 <= value <= MAX_COUNT and value == value.to_integral_value()):
        raise argparse.ArgumentTypeError(
            f"expected a whole number up to 10^18 like 50000000, 50M or 10B (suffixes k, M, G or B, T), got {text!r}"
        )
    return int(value)


def guarded(run: Callable[[], int | None], prefix: str = "error") -> int:
    """Run a command; a UserError becomes one line on stderr and its exit code."""
    try:
        return int(run() or 0)
    except UserError as e:
        print_stderr(f"{prefix}: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`pretrain plan | head`): nothing to report, and the interpreter's own flush
        # of stdout at exit must not fail again; 141 is what a command killed by SIGPIPE returns
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        if e.errno not in NOT_WRITABLE or not e.filename:
            raise
        print_stderr(f"{prefix}: {unwritable_message(e.filename, '', e.strerror)}")
        return UserError.exit_code


def main_for(
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """The `main()` of a subcommand run on its own (`python -m app.train`, `python -m app.budget.cli`)."""

    def go() -> int:
        parser = Parser(prog=prog, description=description)
        add_arguments(parser)
        return run(parser.parse_args(sys.argv[1:] if argv is None else argv))

    return guarded(go)
