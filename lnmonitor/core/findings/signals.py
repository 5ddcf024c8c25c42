"""The candidate signals of one measured step, read from what the meter already has.

One definition serves the live findings (:mod:`lnmonitor.core.findings.reader`) and the testbed
that validated them (:mod:`lnmonitor.experiments.stability`), so a threshold measured on the
testbed means the same figure in a user's run.  Nothing here is recomputed from rows: every
value is a field of the step's :class:`~lnmonitor.core.meter.meter.LadderResult` figures or of its
:class:`~lnmonitor.core.findings.scales.Scales`.  Imports no Lightning and no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lnmonitor.core.findings.scales import Scales
    from lnmonitor.core.meter.ladder import LadderFigures

__all__ = ["CANDIDATES", "JUMP_WINDOW", "SIGNALS", "crosses", "growth_jump", "growth_over_start",
           "growth_rate", "step_signals"]

# name -> what it is (units); the order of the testbed's table
SIGNALS = {
    "growth": "stream growth: rms of the last rung's input over the first's",
    "growth_rate": "growth's rate: change of log10(growth) per step since the previous measured step",
    "attenuation": "1/sigma of the first rung over the last's",
    "inv_sigma_last": "1/sigma of the last rung (the final norm): the factor its backward scales by",
    "inv_sigma_first": "1/sigma of the first rung",
    "first_eps_over_var": "eps/var of the first rung",
    "first_transmission": "eps/(var + eps) of the first rung",
    "final_share_p90": "90th percentile of the final norm's dead-plane share",
    "final_share_max": "largest dead-plane share of the final norm",
    "attention_max": "largest attention logit over every layer",
    "logit_max": "largest output logit",
    "z_mean": "mean log-partition of the output rows (nats)",
    "growth_jump": "growth over its least value in the JUMP_WINDOW steps before: how fast the stream grew",
    "vanished_share": "rows whose gradient vanished (beyond one per sequence) over the rows that should "
                      "have had one, the largest over norms",
}

# Each signal's alarm as stated before the testbed was measured (docs/findings.md): a
# direction (">" above, "<" below, "abs>" absolute value above) and a threshold.  Healthy
# ladders are 3-5x in small models (docs/design.md), so growth and attenuation are given
# room to 20x; eps/var's is the eps law's knee, 27.2 (docs/eps.md).
CANDIDATES: dict[str, tuple[str, float]] = {
    "growth": (">", 20.0),
    "growth_rate": (">", 0.02),
    "attenuation": (">", 20.0),
    "inv_sigma_last": ("<", 0.05),
    "inv_sigma_first": (">", 10.0),
    "first_eps_over_var": (">", 27.2),
    "first_transmission": (">", 0.5),
    "final_share_p90": (">", 0.5),
    "final_share_max": (">", 0.95),
    "attention_max": (">", 30.0),
    "logit_max": (">", 50.0),
    "z_mean": ("abs>", 20.0),
    "vanished_share": (">", 0.05),  # stated with the held-out part, before it was trained
    "growth_jump": (">", 25.0),  # above the fitted part's clean runs (22.35), before the held-out part
}

# the steps growth_jump looks back over
JUMP_WINDOW = 10


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


def growth_jump(recent: Sequence[tuple[int, float]], step: int, growth: float) -> float:
    """``growth`` at ``step`` over the least finite positive growth of ``recent`` (``(step,
    growth)`` pairs read before) at steps ``step - JUMP_WINDOW`` to ``step - 1``: how many times
    the stream grew within the window; nan when no such earlier value exists or ``growth`` is
    not finite."""
    earlier = [g for s, g in recent if step - JUMP_WINDOW <= s < step and math.isfinite(g) and g > 0]
    if not earlier or not math.isfinite(growth):
        return math.nan
    return growth / min(earlier)


def growth_rate(previous: tuple[int, float] | None, step: int, growth: float) -> float:
    """Change of ``log10(growth)`` per step since ``previous = (step, growth)``; nan without a
    previous finite positive growth or a later step."""
    if previous is None or step <= previous[0] or not (previous[1] > 0 and growth > 0):
        return math.nan
    if not (math.isfinite(previous[1]) and math.isfinite(growth)):
        return math.nan
    return (math.log10(growth) - math.log10(previous[1])) / (step - previous[0])


def step_signals(figures: LadderFigures | None, scales: Scales | None = None) -> dict[str, float]:
    """The signals of one measured step (nan where the step has no such figure, e.g. a model
    with one rung, or without ``cross_entropy``); ``growth_rate`` and ``growth_jump`` need
    earlier steps and are left out (the testbed's tables compute them)."""
    nan = math.nan
    out = dict.fromkeys(k for k in SIGNALS if k not in ("growth_rate", "growth_jump"))
    out.update({k: nan for k in out})
    if figures is not None:
        by_name = figures.by_name()
        rungs = [by_name[n] for n in figures.rungs if n in by_name]
        out["growth"], out["attenuation"] = figures.growth, figures.attenuation
        if rungs:
            out["inv_sigma_first"], out["inv_sigma_last"] = rungs[0].inv_sigma, rungs[-1].inv_sigma
            out["first_eps_over_var"] = rungs[0].eps_over_var
            out["first_transmission"] = rungs[0].transmission
        shares = [f.stats.vanished_grad_rows / (f.stats.vanished_grad_rows + f.stats.share_rows)
                  for f in figures.norms if f.stats.vanished_grad_rows + f.stats.share_rows > 0]
        out["vanished_share"] = max(shares, default=nan)
        final = by_name.get(figures.final) if figures.final else None
        if final is not None:
            out["final_share_p90"] = final.stats.share_p90
            out["final_share_max"] = final.stats.share_max
    if scales is not None:
        out["attention_max"] = scales.attention_max
        out["logit_max"], out["z_mean"] = scales.logit_max, scales.z_mean
    return {k: float(v) for k, v in out.items()}
