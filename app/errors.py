"""Errors a user can fix. The CLI prints them as one line and exits 2, never a traceback."""


class UserError(Exception):
    """Bad input, config or data: exit code 2 with a one-line message that says how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """The resolved config is invalid."""


EXIT_PEER_LOST = 144  # a peer rank or node was lost (or the launcher): retried, like 128 + signal
EXIT_OUT_OF_SPACE = 6  # a checkpoint save failed for space: permanent (space does not free itself)
