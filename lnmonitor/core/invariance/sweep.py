"""The scale sweep's fit (:func:`fit_sweep`, :func:`fitted`), and why a point is or is not in it
(:func:`sweep_reason`, the figures' labels).  Imports no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lnmonitor.core.invariance.results import SweepPoint

__all__ = ["FIT_RANGE", "REASONS", "ROUNDING_BELOW", "fit_sweep", "fitted", "sweep_reason"]

FIT_RANGE = (1e-5, 10.0)
ROUNDING_BELOW = 1e-5

# reason -> its words in a figure's legend, in the order a legend lists them
REASONS = {
    "fitted": "in the fit",
    "too_few": "in the window, no fit: fewer than 3 points of one sign",
    "sign": "in the window, left out: the delta-loss changes sign between it and the fit",
    "outside": f"outside the window {FIT_RANGE[0]:g} < eps/var < {FIT_RANGE[1]:g}",
    "rounding": f"float32 rounding, not eps (eps/var <= {ROUNDING_BELOW:g} here and at scale 1)",
}


def sweep_reason(eps_over_var: float, in_fit: bool, rounding: bool, fitted: bool) -> str:
    """The key of :data:`REASONS` for one sweep point whose loss moved: ``in_fit`` and ``rounding`` as the
    sweep flagged it, ``fitted`` whether its run has a slope."""
    if rounding:
        return "rounding"
    if not FIT_RANGE[0] < eps_over_var < FIT_RANGE[1]:
        return "outside"
    if not fitted:
        return "too_few"
    return "fitted" if in_fit else "sign"


def _runs(sweep: Sequence[SweepPoint]) -> tuple[list[SweepPoint], list[list[SweepPoint]]]:
    """The window's points in eps/v order, and their runs of one delta-loss sign."""
    window = sorted((p for p in sweep if p.in_window), key=lambda p: p.eps_over_var)
    runs: list[list[SweepPoint]] = []
    for p in window:
        if runs and (runs[-1][-1].dloss > 0) == (p.dloss > 0):
            runs[-1].append(p)
        else:
            runs.append([p])
    return window, runs


def fitted(sweep: Sequence[SweepPoint]) -> list[SweepPoint]:
    """``sweep`` with ``in_fit`` computed: in the window and in its longest run of one sign."""
    best = max(_runs(sweep)[1], key=len, default=[])
    return [replace(p, in_fit=any(p is q for q in best)) for p in sweep]


def fit_sweep(sweep: Sequence[SweepPoint]) -> tuple[float, float, str]:
    """``(slope, constant, note)`` of ``|dloss| = constant (eps/v)^slope``, or nan and nan with the reason
    there is no fit.  A power law fits one sign: the fit takes the longest run of window points, consecutive
    in eps/v, whose delta-loss has one sign, and needs at least three."""
    window, runs = _runs(sweep)
    best = max(runs, key=len, default=[])
    if len(best) < 3:
        why = (f"{len(window)} point(s) in the window {FIT_RANGE[0]:g} < eps/v < {FIT_RANGE[1]:g}"
               if len(runs) <= 1 else
               f"the delta-loss changes sign in the window, leaving {len(best)} point(s) of one sign")
        return math.nan, math.nan, f"no fit: {why}, fewer than 3"
    fx = np.log([p.eps_over_var for p in best])
    fy = np.log([abs(p.dloss) for p in best])
    slope, intercept = np.polyfit(fx, fy, 1)
    sign = "positive" if best[0].dloss > 0 else "negative"
    note = f"fitted on {len(best)} points with a {sign} delta-loss, eps/v {best[0].eps_over_var:.2g} .. " \
           f"{best[-1].eps_over_var:.2g}"
    if len(runs) > 1:
        note += f"; the delta-loss changes sign in the window ({len(window) - len(best)} point(s) left out)"
    return float(slope), float(math.exp(intercept)), note
