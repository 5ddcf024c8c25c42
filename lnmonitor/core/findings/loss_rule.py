"""The plain loss rule (:class:`LossRule`: when the loss went wrong), and what the norms did when it fired
(:func:`what_the_norms_did`: whether the stream grew, where, and the final norm's ``1/sigma``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LOSS_RULE_AFTER", "LadderSnapshot", "LossRule", "what_the_norms_did"]

# the losses a fit's rule ignores before it judges: a fit's first losses fall fast and set the minimum
LOSS_RULE_AFTER = 10

# The final norm's 1/sigma at the visible event over its value before the blow-up, in every run of the
# mid-run testbed (research/midrun): learning-rate bugs and a collapsed Adam second moment; data bursts.
FELL_IN_OPTIMIZER_BLOWUPS = (0.02, 0.84)
ROSE_IN_DATA_BURSTS = (1.0, 1.64)


class LossRule:
    """The loss over its running minimum: :meth:`ratio` of each step's loss to the lowest before it (nan for
    the first :data:`LOSS_RULE_AFTER` losses and where the minimum is not positive; inf for a non-finite
    loss)."""

    def __init__(self) -> None:
        self.minimum = math.inf
        self.seen = 0

    def ratio(self, loss: float) -> float:
        """This loss over the lowest before it, then the minimum updated."""
        if not math.isfinite(loss):
            return math.inf if self.seen >= LOSS_RULE_AFTER else math.nan
        judged = self.seen >= LOSS_RULE_AFTER and 0 < self.minimum < math.inf
        ratio = loss / self.minimum if judged else math.nan
        self.minimum, self.seen = min(self.minimum, loss), self.seen + 1
        return ratio

    def state_dict(self) -> dict:
        return {"minimum": self.minimum, "seen": self.seen}

    def load_state_dict(self, state: Mapping) -> None:
        self.minimum, self.seen = float(state.get("minimum", math.inf)), int(state.get("seen", 0))


@dataclass(frozen=True)
class LadderSnapshot:
    """One measured step for the diagnosis: each rung's input ``rms`` (forward order), the ladder's
    ``growth`` and the final norm's ``inv_sigma``."""

    step: int
    rms: dict[str, float]
    growth: float
    final_inv_sigma: float

    @classmethod
    def of(cls, step: int, figures) -> LadderSnapshot:
        """From a measured step's :class:`~lnmonitor.core.meter.meter.LadderFigures`."""
        by_name = figures.by_name()
        rms = {name: by_name[name].rms for name in figures.rungs if name in by_name}
        final = by_name.get(figures.final) if figures.final else None
        return cls(step, rms, figures.growth, final.inv_sigma if final is not None else math.nan)


def _x(value: float) -> str:
    return f"{value:,.3g}x" if math.isfinite(value) else "-"


def what_the_norms_did(start: LadderSnapshot | None, before: LadderSnapshot | None,
                       after: LadderSnapshot | None) -> str:
    """What the norms did between the measured step ``before`` the loss went wrong and the one ``after``: the
    ladder's growth (and over the fit's ``start``), the rung whose input rms grew most (and the first
    rung's), the final norm's ``1/sigma``; or why it cannot say."""
    if before is None or after is None or after.step == before.step:
        return "no step was measured around it to compare (the meter is off, or this is the first step)"
    parts = [f"between step {before.step} and step {after.step} the ladder's growth went from "
             f"{_x(before.growth)} to {_x(after.growth)}"
             + (f" ({_x(after.growth / start.growth)} its value at the fit's start)"
                if start is not None and start.growth > 0 else "")]
    grown = {name: after.rms[name] / before.rms[name] for name in after.rms
             if before.rms.get(name, 0) > 0 and math.isfinite(after.rms[name])}
    if grown:
        name, first = max(grown, key=grown.get), next(iter(grown))
        parts.append(f"the stream's rms grew most at {name}'s input ({_x(grown[name])}; at {first}'s "
                     f"{_x(grown[first])})")
    if math.isfinite(after.final_inv_sigma) and before.final_inv_sigma > 0:
        ratio = after.final_inv_sigma / before.final_inv_sigma
        parts.append(f"the final norm's 1/sigma went {_x(ratio)} (it divides the gradient of every layer "
                     "before it by the stream's scale)" + _as_in_the_testbed(ratio))
    return "; ".join(parts)


def _as_in_the_testbed(ratio: float) -> str:
    """Where the final norm's 1/sigma ``ratio`` falls against the testbed's blow-ups."""
    optimizer = "{:g}-{:g}x".format(*FELL_IN_OPTIMIZER_BLOWUPS)
    data = "{:g}-{:g}x".format(*ROSE_IN_DATA_BURSTS)
    if ratio <= FELL_IN_OPTIMIZER_BLOWUPS[1]:
        return (f": as in every learning-rate and optimizer-state blow-up of the testbed ({optimizer} there; "
                f"{data} in its bursts of bad data): check the learning rate and the optimizer's state")
    if ratio >= ROSE_IN_DATA_BURSTS[0]:
        return (f": as in every burst of bad data of the testbed ({data} there; {optimizer} in its "
                "learning-rate and optimizer-state blow-ups): look at the step's data")
    return f" (the testbed's learning-rate and optimizer blow-ups: {optimizer}; its data bursts: {data})"
