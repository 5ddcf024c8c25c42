"""What every monitor shares, with no framework imported: :class:`Messages` (information, and warnings once
per key, from rank zero only), :func:`guarded` (the guard around every entry point: an exception turns the
monitor off with one message, its hooks removed, and training goes on) and :class:`History` (the logged
dicts of a run, kept when nothing else receives them)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["History", "Messages", "due", "entry_points", "guarded", "where"]

_log = logging.getLogger("lnmonitor")


def due(step: int, every_n_steps: int, last_step: int | None = None) -> bool:
    """Whether the monitors measure optimizer step ``step`` (0-based, before its update): every
    ``every_n_steps``-th, and the last when it is known."""
    return step % every_n_steps == 0 or step == last_step


def _print_info(text: str) -> None:
    """The ``lnmonitor`` logger when it is configured to show INFO, else standard error."""
    if _log.isEnabledFor(logging.INFO) and _log.hasHandlers():
        _log.info(text)
    else:
        print(text, file=sys.stderr, flush=True)


# the code between a user's line and a warning of lnmonitor's (contextlib: a ``with monitor.step()``)
_FRAMEWORKS = ("lnmonitor", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
               "transformers", "accelerate", "torch", "contextlib")


def warn_at_user(text: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the first frame, going out, that is neither lnmonitor's nor a
    framework's (the user's ``trainer.fit(...)`` or loop line)."""
    paths = [getattr(sys.modules.get(name), "__file__", None) for name in _FRAMEWORKS]
    # a package's folder, a module's file
    skip = tuple(os.path.dirname(p) + os.sep if p.endswith("__init__.py") else p for p in paths if p)
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, category, stacklevel=level if frame is not None else 2)


class Messages:
    """What a monitor says: ``info(text)``, and ``warn(key, text)`` once per key; ``info``/``warn``
    replace where each goes, ``speaks`` is False on every rank but zero."""

    def __init__(self, info: Callable[[str], None] | None = None,
                 warn: Callable[[str], None] | None = None, speaks: bool = True) -> None:
        self._info = info or _print_info
        self._warn = warn or warn_at_user
        self.speaks = speaks
        self._warned: set[str] = set()

    def info(self, text: str) -> None:
        if self.speaks:
            self._info(text)

    def warn(self, key: str, text: str) -> None:
        """Warn the first time ``key`` comes up (until :meth:`reset`)."""
        if self.speaks and key not in self._warned:
            self._warned.add(key)
            self._warn(text)

    def reset(self, speaks: bool | None = None) -> None:
        """A new run: every key may be said again."""
        self._warned = set()
        if speaks is not None:
            self.speaks = speaks


class History:
    """The dicts a monitor logged in this run, each with its ``step``: kept when ``keep`` is
    True, or when it is None and nothing else receives them (``receivers`` is False)."""

    def __init__(self, keep: bool | None) -> None:
        self.keep = keep
        self.rows: list[dict[str, float]] = []
        self._on = bool(keep)

    def reset(self, receivers: bool) -> None:
        self.rows = []
        self._on = not receivers if self.keep is None else self.keep

    def add(self, step: int, metrics: dict[str, float], *, extend: bool = False) -> None:
        """Keep ``metrics`` at ``step``; ``extend`` adds them to the last row when it is that step's."""
        if not self._on:
            return
        if extend and self.rows and self.rows[-1]["step"] == step:
            self.rows[-1].update(metrics)
        else:
            self.rows.append({"step": step, **metrics})


def off_message(who: str, reason: str) -> str:
    """The sentence saying that ``who`` (a monitor or a part of one) stopped for the run, and why."""
    return f"{who} is off for the rest of this run: {reason}"


def where(err: BaseException) -> str:
    """``file:line in function`` of the innermost frame that raised ``err``."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    path = "/".join(f.filename.replace("\\", "/").split("/")[-2:])
    return f"{path}:{f.lineno} in {f.name}"


def guarded(method: Callable | None = None, *, starts_run: bool = False) -> Callable:
    """Run a monitor's entry point inside the guard; while the monitor is off it returns None.

    The monitor has ``off_reason`` (None while on), ``messages`` (a :class:`Messages`) and ``detach()``
    (remove every hook: called when the guard trips), and may have ``configuration_errors`` (exception
    types that pass through) and ``advice`` (added to the message).  ``starts_run``: the entry point
    that begins a run turns the monitor on again first.  The body stays ``entry.__wrapped__``.
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def entry(self, *args: Any, **kwargs: Any):
            if starts_run:
                self.off_reason = None
            if self.off_reason is not None:
                return None
            try:
                return entry.__wrapped__(self, *args, **kwargs)
            except tuple(getattr(self, "configuration_errors", ())):
                raise
            except Exception as err:  # noqa: BLE001 - the one place a monitor swallows an error
                _trip(self, fn.__name__, err)
                return None

        entry.guarded = True
        return entry

    return wrap(method) if method is not None else wrap


def _trip(monitor, entry: str, err: Exception) -> None:
    monitor.off_reason = f"{type(err).__name__}: {err} (raised at {where(err)}, during {entry})"
    try:
        monitor.detach()
    except Exception as again:  # noqa: BLE001 - say both, stop nothing
        monitor.off_reason += f"; removing its hooks failed too ({type(again).__name__}: {again})"
    name = getattr(monitor, "name", type(monitor).__name__)
    advice = (getattr(monitor, "advice", "")
              or "Please report this with the message if the model and batch look ordinary.")
    monitor.messages.warn("guard", off_message(name, monitor.off_reason) + ". Training goes on; nothing more "
                                   "is measured or logged by it. " + advice)


def entry_points(cls: type) -> list[str]:
    """The names of ``cls``'s guarded entry points."""
    return sorted(name for name in dir(cls) if getattr(getattr(cls, name, None), "guarded", False))
