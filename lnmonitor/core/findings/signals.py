"""The signals the findings read from one measured step's
:class:`~lnmonitor.core.meter.meter.LadderFigures` (the same figures the testbed,
research/stability/candidate_signals.py, read), and :func:`crosses`.  Imports no torch."""

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
    """The ladder's ``growth`` over its value at the fit's first measured step (``start``): what the fit
    itself did to the stream; nan unless both are finite and positive."""
    if not (math.isfinite(growth) and math.isfinite(start) and growth > 0 and start > 0):
        return math.nan
    return growth / start


def step_signals(figures: LadderFigures | None) -> dict[str, float]:
    """``{"growth": ..., "first_eps_over_var": ...}`` of one measured step: the stream's growth (rms of the
    last rung's input over the first's) and the first rung's eps/var; nan where the step has none."""
    if figures is None:
        return {"growth": math.nan, "first_eps_over_var": math.nan}
    by_name = figures.by_name()
    first = next((by_name[n] for n in figures.rungs if n in by_name), None)
    return {"growth": float(figures.growth),
            "first_eps_over_var": float(first.eps_over_var) if first is not None else math.nan}
