"""What the final-norm invariance probe measures: its cases, its scales and its result types (an
:class:`InvarianceResult`'s :meth:`~InvarianceResult.metrics` are what the monitors log)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lnmonitor.core.kinds import NormKind
from lnmonitor.core.output.metric_names import INVARIANCE_CASES, invariance_metric

__all__ = [
    "CASES", "CASE_TRANSFORMS", "PROBE_WINDOWS", "SWEEP_SCALES", "CaseResult", "InvarianceResult",
    "SweepPoint",
]

CASES = INVARIANCE_CASES
# The probe rows of every tool (the monitors' default probe_size, analyze, eps-compare): the first
# PROBE_WINDOWS samples of the held-out data.  The spread of a real delta-loss (scale 3 at eps = 0.1) falls
# as 1/sqrt(windows): 0.37, 0.18, 0.08 of its mean at 8, 32, 128 windows.
PROBE_WINDOWS = 64
SWEEP_SCALES = (1e3, 1e1, 1.0, 1e-1, 1e-2, 3e-3, 1e-3, 1e-4)

# (scale a, shift c, single axis?) of each case: T h = a h + c (1 or e_0)
CASE_TRANSFORMS = {
    "shift_5": (1.0, 5.0, False),
    "shift_1000": (1.0, 1000.0, False),
    "scale_3": (3.0, 0.0, False),
    "scale_3_shift_5": (3.0, 5.0, False),
    "axis_5": (1.0, 5.0, True),
}


@dataclass
class CaseResult:
    """One transformation of the final norm's input."""

    case: str
    scale: float
    shift: float
    dloss: float  # loss(T h) - loss(h), nats
    max_dlogit: float | None  # max |logits(T h) - logits(h)|; None without logits
    out_residual: float  # median over rows of |xhat(T h) - xhat(h)| / |xhat(h)| (float64)
    out_residual_max: float
    expected_residual: float | None  # median of |a sigma/sigma_a - 1|; None when not a*h + c*1


@dataclass(frozen=True)
class SweepPoint:
    """One scale ``a`` of the sweep."""

    scale: float
    dloss: float  # signed: loss(a h) - loss(h), nats
    eps_over_var: float  # median over rows of eps / (a^2 v)
    in_window: bool  # the loss moved and 1e-5 < eps/v < 10 (lnmonitor.core.invariance.sweep.FIT_RANGE)
    rounding: bool  # eps/v <= 1e-5 here and at a = 1, yet the loss moved: float32 rounding
    in_fit: bool = False  # in the window and used by the fit (lnmonitor.core.invariance.sweep.fitted)


@dataclass
class InvarianceResult:
    """Everything :func:`final_norm_invariance` measured."""

    final_norm: str
    kind: NormKind
    eps: float
    rows: int
    base_loss: float
    cases: dict[str, CaseResult] = field(default_factory=dict)
    sweep: list[SweepPoint] = field(default_factory=list)
    slope: float = math.nan
    constant: float = math.nan
    fit_note: str = ""  # how the sweep was fitted, or why it was not (fit_sweep)

    @property
    def rounding_scales(self) -> list[float]:
        return [p.scale for p in self.sweep if p.rounding]

    def metrics(self) -> dict[str, float]:
        """The logged metric names and values (cases without logits omit max_dlogit; a delta-loss of
        exactly zero gets a log10 of nan, which the caller drops)."""
        out: dict[str, float] = {}
        for name, c in self.cases.items():
            out[invariance_metric("dloss", name)] = c.dloss
            log10 = math.log10(abs(c.dloss)) if c.dloss else math.nan
            out[invariance_metric("log10_abs_dloss", name)] = log10
            if c.max_dlogit is not None:
                out[invariance_metric("max_dlogit", name)] = c.max_dlogit
            out[invariance_metric("out_residual", name)] = c.out_residual
        if self.sweep:
            out[invariance_metric("scale_slope")] = self.slope
            out[invariance_metric("scale_constant")] = self.constant
            out[invariance_metric("scale_rounding_points")] = float(len(self.rounding_scales))
        return out


