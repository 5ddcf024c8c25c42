"""Errors that the command line reports as one line with exit code 2, and the warning a
finding is raised with."""

__all__ = ["HealthWarning", "UsageError"]


class UsageError(ValueError):
    """Bad input from the user: the message says what is wrong and what to do."""


class HealthWarning(UserWarning):
    """A finding about the run being monitored (docs/findings.md): what was seen, with the
    numbers, what it meant in the testbed, and what to try.  Raised once per kind per fit;
    ``warnings.filterwarnings("error", category=lnmonitor.HealthWarning)`` makes it stop a run."""
