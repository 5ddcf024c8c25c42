"""The settings every door's ladder takes: one object, one name per setting, checked where it is
built.

:class:`LadderSettings` is what :class:`~lnmonitor.LayerNormMonitor`,
:class:`~lnmonitor.LNMonitorCallback` and :class:`~lnmonitor.LoopMonitor` share of their
constructor arguments; each door builds one from its own and reads it, so a setting has the same
name, default, check and meaning in every door.  What a door has alone (Lightning's
``histograms``, the invariance probe's batch and cadence) stays with the door.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.monitor import arguments

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LadderSettings"]


@dataclass(frozen=True)
class LadderSettings:
    """The ladder's settings of one door, checked when built (:class:`~lnmonitor.core.monitor.
    arguments.ArgumentError` names the argument and what to pass; the Lightning callbacks raise
    it as ``MisconfigurationException``)."""

    every_n_steps: int | None = None
    """Measure every this many optimizer steps, counted from 0, and the last step when it is
    known; None: the framework's own log cadence (Lightning's ``log_every_n_steps``, the
    Trainer's ``logging_steps``)."""

    include: str | Sequence[str] | None = None
    """``fnmatch`` glob(s) over the norms' qualified names: only these are measured (None: all)."""

    exclude: str | Sequence[str] | None = None
    """Glob(s) of norms left out (after ``include``)."""

    final_norm: str | None = None
    """Qualified name of the final norm; None: the meter finds it on the first measured step (the
    last norm to run whose input reaches the loss through it alone).  The invariance probe checks
    the same norm."""

    ladder: str | Sequence[str] | None = None
    """Glob(s) naming the ladder's rungs; None: found from the gradient on the first measured step
    (a norm whose input flows on past it reads the residual stream)."""

    row_mask: Callable | bool | None = None
    """``row_mask(batch)`` -> bool tensor, True on the rows (tokens) to measure; None: the batch's
    padding (``attention_mask`` 0, ``labels`` -100) is left out; False: every row counts."""

    images: bool = True
    """Log the ladder's picture on measured steps and the ladder over training at the end."""

    image_every_n_steps: int = 50
    """The least number of steps between two ladder pictures (the last step gets one)."""

    summary: bool = True
    """Print the one-screen summary at the end of training (rank zero)."""

    keep_history: bool | None = None
    """Keep every logged dict in ``.history``; None: only where nothing else receives them."""

    def __post_init__(self) -> None:
        checked = {
            "every_n_steps": arguments.positive_int(self.every_n_steps, "every_n_steps"),
            "include": arguments.patterns(self.include, "include"),
            "exclude": arguments.patterns(self.exclude, "exclude"),
            "final_norm": arguments.module_name(self.final_norm, "final_norm", "transformer.ln_f"),
            "ladder": arguments.patterns(self.ladder, "ladder"),
            "row_mask": arguments.row_mask(self.row_mask),
            "images": arguments.flag(self.images, "images"),
            "image_every_n_steps": arguments.positive_int(self.image_every_n_steps, "image_every_n_steps",
                                                          allow_none=False),
            "summary": arguments.flag(self.summary, "summary"),
            "keep_history": arguments.optional_flag(self.keep_history, "keep_history"),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def meter(self, model: nn.Module, owner: str, say: Callable[[str], None],
              warn: Callable[[str, str], None], watch_growth: bool) -> LadderMeter:
        """The door's :class:`~lnmonitor.core.meter.meter.LadderMeter` of ``model`` with these settings."""
        return LadderMeter(model, include=self.include, exclude=self.exclude, final_norm=self.final_norm,
                           ladder=self.ladder, row_mask=self.row_mask, owner=owner, say=say, warn=warn,
                           watch_growth=watch_growth)
