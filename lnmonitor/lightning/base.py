"""What every lnmonitor Lightning callback shares: its :class:`~lnmonitor.lightning.loggers.Loggers`,
``history``, messages (rank zero), guard and the last logged step in its checkpoint state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lnmonitor.core.monitor.arguments import ArgumentError
from lnmonitor.core.monitor.shared import Messages, warn_at_user
from lnmonitor.core.norms.discovery import NormSelectionError
from lnmonitor.lightning.loggers import Loggers

__all__ = ["MonitorCallback", "misconfiguration"]


@contextlib.contextmanager
def misconfiguration() -> Iterator[None]:
    """Bad arguments and unmeasurable models raised inside as ``MisconfigurationException``, same message."""
    try:
        yield
    except (ArgumentError, NormSelectionError) as err:
        raise MisconfigurationException(str(err)) from None


class MonitorCallback(Callback):
    """A callback that logs through its own :class:`~lnmonitor.lightning.loggers.Loggers`.

    Its hooks run inside :func:`~lnmonitor.core.monitor.shared.guarded`: an exception there turns the callback
    off for the rest of the fit with one warning (``off_reason``), :meth:`detach` removes its hooks and the
    fit goes on.  ``MisconfigurationException`` (bad arguments, no norm to measure) is raised."""

    configuration_errors = (MisconfigurationException,)

    def __init__(self, keep_history: bool | None) -> None:
        self.name = type(self).__name__
        self.messages = Messages(info=rank_zero_info, warn=rank_zero_only(warn_at_user))
        self.off_reason: str | None = None
        self._loggers = Loggers(self.name, keep_history, self.messages)

    def detach(self) -> None:
        """Remove every hook and forget the step in progress (the guard tripped)."""

    @property
    def history(self) -> list[dict[str, float]]:
        """Every dict logged in the current fit, with its ``step`` (see ``keep_history``)."""
        return self._loggers.history

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_step": self._loggers.last_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loggers.last_step = int(state_dict.get("last_logged_step", -1))
