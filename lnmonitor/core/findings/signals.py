"""The signals the findings read from one measured step: figures the meter already has.

One definition serves the live findings (:mod:`lnmonitor.core.findings.reader`) and the testbed
that validated them (:mod:`lnmonitor.experiments.stability.candidate_signals` adds the testbed's other
candidates: rates, jumps and the scales no norm governs), so a threshold measured on the testbed
means the same figure in a user's run.  Nothing here is recomputed from rows: every value is a
field of the step's :class:`~lnmonitor.core.meter.ladder.LadderFigures`.  Imports no Lightning
and no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lnmonitor.core.meter.ladder import LadderFigures

__all__ = ["SIGNALS", "crosses", "growth_over_start", "step_signals"]

# name -> what it is (units)
SIGNALS = {
    "growth": "stream growth: rms of the last rung's input over the first's",
    "attenuation": "1/sigma of the first rung over the last's",
    "inv_sigma_last": "1/sigma of the last rung (the final norm): the factor its backward scales by",
    "inv_sigma_first": "1/sigma of the first rung",
    "first_eps_over_var": "eps/var of the first rung",
    "first_transmission": "eps/(var + eps) of the first rung",
    "final_share_p90": "90th percentile of the final norm's dead-plane share",
    "final_share_max": "largest dead-plane share of the final norm",
    "vanished_share": "rows whose gradient vanished (where the final norm's row has one) over the rows "
                      "that should have had one, the largest over norms",
}

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
    """The signals of one measured step (nan where the step has no such figure, e.g. a model
    with one rung)."""
    nan = math.nan
    out = dict.fromkeys(SIGNALS, nan)
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
    return {k: float(v) for k, v in out.items()}
