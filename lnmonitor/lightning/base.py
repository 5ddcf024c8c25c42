"""What every lnmonitor Lightning callback shares: its metric sink, ``history``, the
messages it says (rank zero) and the last step it logged in its checkpoint state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lnmonitor.core.arguments import ArgumentError
from lnmonitor.core.discovery import NormSelectionError
from lnmonitor.lightning.sink import MetricSink

__all__ = ["MonitorCallback", "misconfiguration"]


@contextlib.contextmanager
def misconfiguration() -> Iterator[None]:
    """Bad arguments and unmeasurable models raised inside as Lightning's
    ``MisconfigurationException``, with the same message."""
    try:
        yield
    except (ArgumentError, NormSelectionError) as err:
        raise MisconfigurationException(str(err)) from None


class MonitorCallback(Callback):
    """A callback that logs through its own :class:`~lnmonitor.lightning.sink.MetricSink`."""

    def __init__(self, keep_history: bool | None) -> None:
        self._sink = MetricSink(type(self).__name__, keep_history)

    @property
    def history(self) -> list[dict[str, float]]:
        """Every dict logged in the current fit, with its ``step`` (see ``keep_history``)."""
        return self._sink.history

    @staticmethod
    def _say(text: str) -> None:
        rank_zero_info(text)

    def _warn(self, key: str, text: str) -> None:
        self._sink.warn_once(key, text)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_step": self._sink.last_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._sink.last_step = int(state_dict.get("last_logged_step", -1))
