"""What the experiments' figures share beside :mod:`lnmonitor.views.plotting`: the scale sweep's points drawn
by why each is in its fit or not."""

from __future__ import annotations

import math

from lnmonitor.core.invariance.sweep import REASONS, sweep_reason

__all__ = ["scatter_sweep", "sweep_legend"]

# marker and fill of a sweep point, per reason (lnmonitor.core.invariance.sweep.REASONS)
_SWEEP_STYLE = {"fitted": ("o", True), "too_few": ("s", False), "sign": ("D", False),
                "outside": ("o", False), "rounding": ("x", True)}


def scatter_sweep(ax, points, fitted: bool, color: str) -> set[str]:
    """One run's scale-sweep points ``(eps_over_var, dloss, in_fit, rounding)`` on ``ax`` (log-log, abs(delta
    loss)), each in the style of its reason; points whose loss did not move are left out.  Returns the
    reasons drawn, for :func:`sweep_legend`."""
    drawn: set[str] = set()
    for reason, (marker, filled) in _SWEEP_STYLE.items():
        sel = [(x, abs(d)) for x, d, in_fit, rounding in points if x > 0 and d != 0 and math.isfinite(d)
               and sweep_reason(x, in_fit, rounding, fitted) == reason]
        if sel:
            style = {"color": color} if marker == "x" else {
                "facecolors": color if filled else "none", "edgecolors": color}
            ax.scatter(*zip(*sel, strict=True), marker=marker, s=24, **style)
            drawn.add(reason)
    return drawn


def sweep_legend(ax, reasons: set[str], lines: dict[str, str] | None = None) -> None:
    """A legend of the reasons drawn (black markers) and of ``lines`` (label -> colour)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=2, label=label) for label, c in (lines or {}).items()]
    for reason, (marker, filled) in _SWEEP_STYLE.items():
        if reason in reasons:
            handles.append(Line2D([], [], linestyle="none", marker=marker, color="black",
                                  markerfacecolor="black" if filled else "none", label=REASONS[reason]))
    ax.legend(handles=handles, fontsize=7, loc="upper left")
