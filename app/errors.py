"""Errors a user can fix, and every exit code of the job in one table. A UserError is printed as one
line, never a traceback. Under the PyTorchJob `ExitCode` restart policy 1-127 are permanent (the job
fails), codes >= 128 are retried (128 + N: stopped by signal N, e.g. 143 for SIGTERM).
"""

import sys

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
    print(line, file=sys.stderr, flush=True)
