"""Errors a user can fix, and every exit code of the job in one table. A UserError is printed as one
line, never a traceback. Under the PyTorchJob `ExitCode` restart policy 1-127 are permanent (the job
fails), codes >= 128 are retried (128 + N: stopped by signal N, e.g. 143 for SIGTERM).

EXIT_CODES is the one description of the codes: docs/contracts.md's table is generated from it
(`python -m app.errors docs/contracts.md` rewrites it between its markers) and `pretrain --help` prints
it, so the two cannot drift apart (tests/test_exit_codes.py compares both with it).
"""

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

EXIT_BAD_INPUT = 2  # bad input, config or data (also an unwritable checkpoint volume)
EXIT_DIVERGED = 3  # train.max_bad_steps non-finite steps in a row: a restart would diverge again
EXIT_DATA_NOT_READY = 4  # the wait-for-data step gave up on the training data
EXIT_RETRIES_SPENT = 5  # the launcher's retry budget (trainer.maxRestarts) is spent
EXIT_OUT_OF_SPACE = 6  # a checkpoint save failed for space (space does not free itself)
EXIT_LOW_MFU = 7  # train.mfu_floor: a restart on the same node pool would burn the budget at the same pace
EXIT_LEASE_BUSY = 142  # 128 + SIGALRM: another trainer holds the run dir's lease (retried later)
EXIT_PEER_LOST = 144  # a peer rank or node (or the launcher) was lost: retried, like 128 + signal
EXIT_SMALLER_BATCH = (
    145  # out of memory at an auto micro-batch on several ranks: a smaller one is recorded, retried
)


@dataclass(frozen=True)
class ExitCode:
    """One exit code: what it means (one line) and what Kubernetes does with it."""

    code: str  # the code, or a rule for a family of codes ("128 + N")
    meaning: str  # when the job exits with it
    kubernetes: str  # what the PyTorchJob `ExitCode` restart policy does with it


EXIT_CODES = (
    ExitCode(
        "0",
        "done: a planned end (max steps / tokens / hours), a budget stop, an early stop, an immediate stop, "
        "or the budget already spent",
        "Succeeded, not restarted",
    ),
    ExitCode(
        "1",
        "an unexpected crash (`status.json` says `failed`); in a pod also a crash of the wait-for-data step "
        "or of the budget watcher before it watched",
        "Failed, not restarted",
    ),
    ExitCode(
        str(EXIT_BAD_INPUT),
        "bad input, config or data, said in one line on stderr; in a pod also a run dir or ledger its uid "
        "cannot write, or a budget watcher that cannot start",
        "Failed, not restarted",
    ),
    ExitCode(
        str(EXIT_DIVERGED),
        "diverged: `train.max_bad_steps` non-finite steps in a row; the last good weights are saved",
        "Failed, not restarted (a restart would diverge again)",
    ),
    ExitCode(
        str(EXIT_DATA_NOT_READY),
        "no training data: the wait-for-data step gave up (the prepare Job failed or is missing, or "
        "`prepare.wait.timeoutSeconds` passed)",
        "Failed, not restarted (`DataNotReady` Event)",
    ),
    ExitCode(
        str(EXIT_RETRIES_SPENT),
        "the launcher's retry budget is spent: more than `trainer.maxRestarts` failed attempts in a row "
        "without a new checkpoint",
        "Failed, not restarted (the operator alone would retry forever)",
    ),
    ExitCode(
        str(EXIT_OUT_OF_SPACE),
        "out of space on the checkpoint volume: a save failed for ENOSPC/EDQUOT; the earlier checkpoints "
        "are intact",
        "Failed, not restarted (space does not free itself: grow the volume or free space, then resubmit)",
    ),
    ExitCode(
        str(EXIT_LOW_MFU),
        "MFU stayed under `train.mfu_floor` for `train.mfu_floor_minutes` after warm-up; the run saved first",
        "Failed, not restarted (a restart on the same node pool would run as slowly), `LowMFU` Event",
    ),
    ExitCode(
        "128 + N",
        "stopped by signal N after a checkpoint: 143 SIGTERM (preemption, node drain, `kubectl delete`), "
        "130 SIGINT",
        "retried; resumes from the checkpoint",
    ),
    ExitCode(
        str(EXIT_LEASE_BUSY),
        "another trainer still holds the run dir's lease after `checkpoint.lease_wait_seconds`",
        "retried",
    ),
    ExitCode(
        str(EXIT_PEER_LOST),
        "a peer rank or node was lost without a signal: every other rank exits within about 45 s, naming "
        "the lost one and the step",
        "retried; counted toward `trainer.maxRestarts` only without a new checkpoint since the last failure",
    ),
    ExitCode(
        str(EXIT_SMALLER_BATCH),
        "out of memory in the first steps at `train.micro_batch_size=auto` on several ranks: the smaller "
        "micro-batch is recorded in `RUN_DIR/oom.json` for the restart",
        "retried at the recorded size; counted toward `trainer.maxRestarts` only without a new checkpoint "
        "since the last failure",
    ),
)


def exit_codes_markdown() -> str:
    """The table in docs/contracts.md."""
    rows = [
        "| exit code | meaning | Kubernetes (PyTorchJob `restartPolicy: ExitCode`) |",
        "|---|---|---|",
    ]
    rows += [f"| {e.code} | {e.meaning} | {e.kubernetes} |" for e in EXIT_CODES]
    return "\n".join(rows) + "\n"


# The generated table's markers in a Markdown page.
TABLE_BEGIN = (
    "<!-- exit codes: generated from app/errors.py by `python -m app.errors docs/contracts.md` -->\n"
)
TABLE_END = "<!-- end of exit codes -->\n"


def write_table(page: Path) -> None:
    """Rewrite the table between its markers in `page`, leaving the rest of the page as it is."""
    text = page.read_text()
    head, rest = text.split(TABLE_BEGIN, 1)
    tail = rest.split(TABLE_END, 1)[1]
    page.write_text(head + TABLE_BEGIN + exit_codes_markdown() + TABLE_END + tail)


def exit_codes_help() -> str:
    """The table as the `--help` epilogue prints it: each code, then its meaning wrapped beside it."""
    lines = ["exit codes (1-127 permanent, >= 128 retried under the PyTorchJob ExitCode policy):"]
    for e in EXIT_CODES:
        text = e.meaning.replace("`", "")
        lines += textwrap.wrap(
            text,
            width=100,
            initial_indent=f"  {e.code:<8}",
            subsequent_indent=" " * 10,
            break_on_hyphens=False,
        )
    return "\n".join(lines) + "\n"


class UserError(Exception):
    """Bad input, config or data: a one-line message that says how to fix it."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(UserError):
    """The resolved config is invalid."""


class RestartSmaller(UserError):
    """train.micro_batch_size=auto ran out of memory on one of several ranks: the smaller micro-batch is
    recorded in the run dir, and the restart (retryable exit code) starts with it."""

    exit_code = EXIT_SMALLER_BATCH


def print_stderr(line: str) -> None:
    """One line on stderr in one write: under PYTHONUNBUFFERED (the image sets it) print() writes the text
    and its newline apart, and the lines of ranks that share a log would run into each other."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    # with a page: rewrite its table; without: print the table
    if len(sys.argv) > 1:
        write_table(Path(sys.argv[1]))
    else:
        print(exit_codes_markdown(), end="")
