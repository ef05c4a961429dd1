"""What every `pretrain` subcommand shares: a parser whose errors are one line, and the exit-code rule.

Exit codes: 0 done; 2 bad input, config or data (one line on stderr, no traceback); 130 Ctrl-C.
A file this user may not write (a root-owned volume, a read-only mount) is bad input too: one line
naming the path, the uid and the fix, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from app.errors import UserError
from app.files import NOT_WRITABLE, unwritable_message


class Parser(argparse.ArgumentParser):
    """argparse with bad flags reported like every other bad input: one line, exit 2."""

    def error(self, message: str) -> None:
        raise UserError(f"{self.prog}: {message} (see --help)")


def guarded(run: Callable[[], int | None], prefix: str = "error") -> int:
    """Run a command; a UserError becomes one line on stderr and its exit code."""
    try:
        return int(run() or 0)
    except UserError as e:
        print(f"{prefix}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if e.errno not in NOT_WRITABLE or not e.filename:
            raise
        print(f"{prefix}: {unwritable_message(e.filename, '', e.strerror)}", file=sys.stderr, flush=True)
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
