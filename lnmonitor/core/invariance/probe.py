"""The final-norm invariance probe of one model, with its state, which every monitor drives."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from lnmonitor.core.invariance.final_norm import (
    FINAL_BYPASS_TOLERANCE,
    NotAFinalNorm,
    final_norm_bypass,
    find_final_norm,
    named_norm,
)
from lnmonitor.core.invariance.loss_contract import LossFn, default_loss
from lnmonitor.core.invariance.measure import final_norm_invariance
from lnmonitor.core.invariance.results import CASES, SWEEP_SCALES, InvarianceResult
from lnmonitor.core.meter.meter import finite_metrics
from lnmonitor.core.norms.find import NormInfo, find_norms

if TYPE_CHECKING:
    from lnmonitor.core.meter.meter import LadderMeter

__all__ = ["InvarianceProbe", "NonFiniteLoss"]


class NonFiniteLoss(ValueError):
    """The loss on the probe rows is not finite (a diverged model): no point to measure now."""


class InvarianceProbe:
    """The final-norm invariance probe of one model, run whenever its driver decides. The first :meth:`run`
    takes the final norm: ``final_norm`` when named; else the ``meter``'s
    (:attr:`~lnmonitor.core.meter.meter.LadderMeter.final`, once a measured step found it); else the last of
    ``norms`` to run on the batch. It checks once with
    :func:`~lnmonitor.core.invariance.final_norm.final_norm_bypass` that the loss reaches its input only
    through it (else raises :class:`~lnmonitor.core.invariance.final_norm.NotAFinalNorm`), then runs
    :func:`~lnmonitor.core.invariance.measure.final_norm_invariance` with ``loss_fn``, ``cases``, ``scales``,
    ``autocast`` and ``norms`` (default: the ``meter``'s, else every norm of the model)."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn | None = None, *, final_norm: str | None = None,
        cases: Sequence[str] = CASES, scales: Sequence[float] = SWEEP_SCALES,
        autocast: Callable[[], object] | None = None, norms: Sequence[NormInfo] | None = None,
        meter: LadderMeter | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn or default_loss
        self.named = final_norm is not None
        self.final_norm = final_norm
        self.cases, self.scales, self.autocast = tuple(cases), tuple(scales), autocast
        self.meter = meter
        if norms is None:
            norms = meter.norms if meter is not None else find_norms(model)
            if final_norm is not None and all(n.name != final_norm for n in norms):
                norms = find_norms(model)  # a final norm named outright is probed, measured or not
        self.norms = list(norms)
        self.checked = False
        self.last: InvarianceResult | None = None  # the last point (see point())
        self.last_step = -1

    def sweep_missing(self, step: int) -> bool:
        """Whether ``step`` was probed last, without its sweep (see :meth:`point`)."""
        return step == self.last_step and self.last is not None and not self.last.sweep and bool(self.scales)

    def point(self, batch, step: int, *, sweep: bool) -> tuple[InvarianceResult, dict[str, float]]:
        """The probe run of training ``step``: the cases, and the sweep too with ``sweep``.  A step probed
        last without its sweep gets the sweep alone, added to it.  Returns the result and its new finite
        metrics."""
        if sweep and self.sweep_missing(step):
            last, swept = self.last, self.run(batch, cases=False)
            result = replace(last, sweep=swept.sweep, slope=swept.slope, constant=swept.constant,
                             fit_note=swept.fit_note)
            before = last.metrics()
            metrics = {k: v for k, v in finite_metrics(result.metrics()).items() if k not in before}
        else:
            result = self.run(batch, sweep=sweep)
            metrics = finite_metrics(result.metrics())
        self.last, self.last_step = result, step
        return result, metrics

    def run(self, batch, *, cases: bool = True, sweep: bool = True) -> InvarianceResult:
        """One run on ``batch``: the cases and/or the sweep (``cases``/``sweep`` False leave them out)."""
        if self.final_norm is None and self.meter is not None:
            self.final_norm = self.meter.final
        if self.final_norm is None:
            self.final_norm = find_final_norm(self.model, batch, self.loss_fn, self.norms)
        if not self.checked:
            bypass = final_norm_bypass(self.model, batch, named_norm(self.norms, self.final_norm).module,
                                       loss_fn=self.loss_fn, autocast=self.autocast)
            if bypass > FINAL_BYPASS_TOLERANCE:
                name = self.final_norm
                who = f"final_norm={name!r}" if self.named else f"the last norm to run, {name!r},"
                raise NotAFinalNorm(
                    f"{who} is not a final norm: part of the loss gradient at its input goes around it "
                    f"(relative size {bypass:.3g}; a residual path carries that input on), so the loss is "
                    "not invariant to shifting or scaling it and there is no final-norm invariance to check. "
                    "The model seems to have no final norm before its head; if it has one, name it with "
                    "final_norm=...")
            self.checked = True
        result = final_norm_invariance(
            self.model, batch, self.final_norm, loss_fn=self.loss_fn, cases=self.cases if cases else (),
            scales=self.scales if sweep else (), autocast=self.autocast, norms=self.norms,
        )
        if not math.isfinite(result.base_loss):
            raise NonFiniteLoss(f"the loss on the probe rows is {result.base_loss}: there is no change of it "
                                "to measure (has the model diverged?)")
        return result
