"""Errors that the command line reports as one line with exit code 2."""

__all__ = ["UsageError"]


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and what to do."""
