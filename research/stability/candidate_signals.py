"""The stability testbed's candidate signals: the findings' own (``growth`` and
``first_eps_over_var``, :func:`lnmonitor.core.findings.signals.step_signals`) and the ones tested
beside them and not shipped -- other figures of the ladder, rates and jumps of the growth over
earlier steps, and the scales no norm governs (attention and output logits,
:mod:`research.stability.scales`).  Each candidate's alarm was stated before the testbed measured
it (docs/findings.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lnmonitor.core.findings.signals import step_signals

if TYPE_CHECKING:
    from lnmonitor.core.meter.meter import LadderFigures
    from research.stability.scales import Scales

__all__ = ["CANDIDATES", "CANDIDATE_SIGNALS", "JUMP_WINDOW", "STEP_SIGNALS", "candidate_signals",
           "growth_jump", "growth_rate"]

# name -> what it is (units): the findings' signals (growth, first_eps_over_var) and the testbed's others
CANDIDATE_SIGNALS = {
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
    "growth_rate": "growth's rate: change of log10(growth) per step since the previous measured step",
    "attention_max": "largest attention logit over every layer",
    "logit_max": "largest output logit",
    "z_mean": "mean log-partition of the output rows (nats)",
    "growth_jump": "growth over its least value in the JUMP_WINDOW steps before: how fast the stream grew",
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


# the signals of one measured step: growth_rate and growth_jump need earlier steps
STEP_SIGNALS = tuple(k for k in CANDIDATE_SIGNALS if k not in ("growth_rate", "growth_jump"))


def candidate_signals(figures: LadderFigures | None, scales: Scales | None = None) -> dict[str, float]:
    """The :data:`STEP_SIGNALS` of one measured step (nan where the step has no such figure, e.g.
    a model with one rung or without ``cross_entropy``); ``growth_rate`` and ``growth_jump`` are
    left out (the testbed's tables compute them)."""
    out = dict.fromkeys(STEP_SIGNALS, math.nan)
    out.update(step_signals(figures))
    if figures is not None:
        by_name = figures.by_name()
        rungs = [by_name[n] for n in figures.rungs if n in by_name]
        out["attenuation"] = figures.attenuation
        if rungs:
            out["inv_sigma_first"], out["inv_sigma_last"] = rungs[0].inv_sigma, rungs[-1].inv_sigma
            out["first_transmission"] = rungs[0].transmission
        shares = [f.stats.vanished_grad_rows / (f.stats.vanished_grad_rows + f.stats.share_rows)
                  for f in figures.norms if f.stats.vanished_grad_rows + f.stats.share_rows > 0]
        out["vanished_share"] = max(shares, default=math.nan)
        final = by_name.get(figures.final) if figures.final else None
        if final is not None:
            out["final_share_p90"] = final.stats.share_p90
            out["final_share_max"] = final.stats.share_max
    if scales is not None:
        out["attention_max"] = scales.attention_max
        out["logit_max"], out["z_mean"] = scales.logit_max, scales.z_mean
    return {k: float(v) for k, v in out.items()}
