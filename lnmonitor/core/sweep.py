"""The scale sweep's fit window, and why a sweep point is or is not in the fit.

:mod:`lnmonitor.core.invariance` measures the sweep and fits ``|dloss| = c (eps/v)^slope``
on the longest run of one sign inside :data:`FIT_RANGE`; the figures of ``analyze`` and
``lnmonitor report`` label every point with :func:`sweep_reason`.  Imports nothing, so
the report reads it without torch.
"""

from __future__ import annotations

__all__ = ["FIT_RANGE", "REASONS", "ROUNDING_BELOW", "sweep_reason"]

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
    """The key of :data:`REASONS` for one sweep point whose loss moved: ``in_fit`` and
    ``rounding`` as the sweep flagged it, ``fitted`` whether its run has a slope."""
    if rounding:
        return "rounding"
    if not FIT_RANGE[0] < eps_over_var < FIT_RANGE[1]:
        return "outside"
    if not fitted:
        return "too_few"
    return "fitted" if in_fit else "sign"
