"""Measure a trained model on held-out text, the one pipeline behind ``lnmonitor analyze`` and ``lnmonitor
eps-compare`` (:func:`held_out_measurement`), for a module whose ``forward(x, y)`` returns ``(logits, loss)``:
the loss over every held-out window; every norm's statistics, measured by a
:class:`~lnmonitor.core.meter.meter.LadderMeter` as one step (the monitors' roles, ladder, baselines and
names); the final norm's invariance cases and scale sweep on the probe rows, the first
:data:`~lnmonitor.core.invariance.results.PROBE_WINDOWS` held-out windows, as the invariance monitor probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lnmonitor.core.hooks import eval_mode
from lnmonitor.core.invariance.measure import final_norm_invariance
from lnmonitor.core.invariance.probe_rows import first_samples, probe_batch
from lnmonitor.core.invariance.results import PROBE_WINDOWS, InvarianceResult
from lnmonitor.core.meter.heldout import held_out_result
from lnmonitor.core.meter.meter import LadderMeter, LadderResult
from lnmonitor.core.norms.find import NormInfo

__all__ = ["Measurement", "held_out_loss", "held_out_measurement", "held_out_probe", "tiny_loss"]

Batch = tuple[Tensor, Tensor]


@dataclass
class Measurement:
    """What :func:`held_out_measurement` found.  ``windows`` counts the held-out windows behind ``loss``,
    ``norms`` and ``invariance``; ``result`` is the meter's; ``order`` lists the norms in call order."""

    val_loss: float
    windows: dict[str, int]
    result: LadderResult
    order: list[str]
    invariance: InvarianceResult | None

    @property
    def norms(self) -> list[NormInfo]:
        """The measured norms, with their roles."""
        return self.result.norms


def tiny_loss(module: nn.Module, batch: Batch) -> Tensor:
    """The loss of a module whose ``forward(x, y)`` returns ``(logits, loss)``."""
    return module(*batch)[1]


def held_out_loss(module: nn.Module, batches: Sequence[Batch]) -> float:
    """Mean loss (nats per token) over every window of ``batches``, in eval mode."""
    total, windows = 0.0, 0
    with eval_mode(module), torch.no_grad():
        for batch in batches:
            total += float(tiny_loss(module, batch)) * batch[0].shape[0]
            windows += batch[0].shape[0]
    return total / windows


def held_out_probe(batches: Sequence[Batch], windows: int = PROBE_WINDOWS) -> Batch:
    """The probe rows: the first ``windows`` held-out windows as one batch, as the invariance monitor does."""
    return probe_batch(first_samples(iter(batches), windows), windows)


def held_out_measurement(
    module: nn.Module, batches: Sequence[Batch], *, norm_batches: int | None = None,
    invariance: bool = True, counts: bool = False,
) -> Measurement:
    """Measure ``module`` on the held-out ``batches``.  ``norm_batches``: how many batches the norm statistics
    use (all when None); ``counts``: keep the row statistics' histograms."""
    val_loss = held_out_loss(module, batches)
    norm_set = list(batches if norm_batches is None else batches[:norm_batches])
    meter = LadderMeter(module, name="lnmonitor")
    result = held_out_result(meter, norm_set, tiny_loss, counts=counts)
    probe = held_out_probe(batches)
    inv = (final_norm_invariance(module, probe, final_norm=result.figures.final, norms=result.norms)
           if invariance else None)
    return Measurement(
        val_loss=val_loss,
        windows={"loss": sum(b[0].shape[0] for b in batches), "norms": sum(b[0].shape[0] for b in norm_set),
                 "invariance": int(probe[0].shape[0]) if invariance else 0},
        result=result, order=list(meter.order), invariance=inv,
    )
