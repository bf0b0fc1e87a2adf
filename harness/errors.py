"""Errors the CLI turns into one line on stderr and exit code 2."""


class UsageError(Exception):
    """Bad input: the message names the value, the invariant and the fix, on one line."""
