"""The signals the findings read from one measured step: figures the meter already has.

:func:`step_signals` gives the ladder's ``growth`` (judged as :func:`growth_over_start`) and the
first rung's ``first_eps_over_var``; :func:`crosses` says whether a value is past a threshold.
The testbed that validated them (research/stability/candidate_signals.py) reads these same
figures beside its other candidates, so a threshold measured there means the same figure in a
user's run.  Nothing here is recomputed from rows: every value is a field of the step's
:class:`~lnmonitor.core.meter.meter.LadderFigures`.  Imports no Lightning and no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lnmonitor.core.meter.meter import LadderFigures

__all__ = ["crosses", "growth_over_start", "step_signals"]


def crosses(value: float, direction: str, threshold: float) -> bool:
    """Whether ``value`` is past ``threshold`` in ``direction``; never for nan."""
    if not math.isfinite(value):
        return False
    if direction == ">":
        return value > threshold
    if direction == "<":
        return value < threshold
    return abs(value) > threshold


def growth_over_start(growth: float, start: float) -> float:
    """The ladder's ``growth`` over its value at the fit's first measured step (``start``): what
    the fit itself did to the stream, whatever the model it started from had (a pretrained
    checkpoint's ladder is tall from the start); nan unless both are finite and positive."""
    if not (math.isfinite(growth) and math.isfinite(start) and growth > 0 and start > 0):
        return math.nan
    return growth / start


def step_signals(figures: LadderFigures | None) -> dict[str, float]:
    """``{"growth": ..., "first_eps_over_var": ...}`` of one measured step: the stream's growth
    (rms of the last rung's input over the first's) and eps/var of the first rung; nan where the
    step has no such figure (no ladder, a model with one rung)."""
    if figures is None:
        return {"growth": math.nan, "first_eps_over_var": math.nan}
    by_name = figures.by_name()
    first = next((by_name[n] for n in figures.rungs if n in by_name), None)
    return {"growth": float(figures.growth),
            "first_eps_over_var": float(first.eps_over_var) if first is not None else math.nan}
