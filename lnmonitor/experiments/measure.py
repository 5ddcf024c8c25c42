"""Measure a trained model on held-out text: the one pipeline behind ``lnmonitor analyze``
and ``lnmonitor eps-compare``.

:func:`measure_held_out` takes a module whose ``forward(x, y)`` returns ``(logits, loss)`` (the
tiny GPT's contract) and the fixed held-out batches ``(x, y)``, and returns a
:class:`Measurement`:

* the loss over every held-out window (eval mode, nats per token);
* every norm's rows in float64 over the first ``norm_batches`` batches
  (:mod:`lnmonitor.core.heldout`): the dead-plane shares against the random baseline and the
  1/sigma ladder;
* the final norm's invariance cases and scale sweep (:mod:`lnmonitor.core.invariance`) on the
  *probe rows*: the first :data:`~lnmonitor.core.invariance.PROBE_WINDOWS` held-out windows
  (spread over the held-out text), whatever ``norm_batches`` is -- the rows the
  invariance monitor probes by default too, so every tool measures one checkpoint on the
  same rows.

The norms are found once here and passed down to every measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lnmonitor.core.heldout import LadderRow, NormRows, ShareRow, measure_norm_rows, share_table, sigma_ladder
from lnmonitor.core.invariance import PROBE_WINDOWS, InvarianceResult, final_norm_invariance
from lnmonitor.core.norms import NormInfo, find_norms

__all__ = ["Measurement", "held_out_loss", "measure_held_out", "probe_rows", "tiny_loss"]

Batch = tuple[Tensor, Tensor]


@dataclass
class Measurement:
    """What :func:`measure_held_out` found.  ``windows`` counts the held-out windows behind each part
    (``loss``, ``norms``, ``invariance``); ``rows``/``shares``/``ladder`` list the norms in
    the order the forward first calls them."""

    norms: list[NormInfo]
    val_loss: float
    windows: dict[str, int]
    rows: list[NormRows]
    shares: list[ShareRow]
    ladder: list[LadderRow]
    attenuation: float
    growth: float
    invariance: InvarianceResult | None


def tiny_loss(module: nn.Module, batch: Batch) -> Tensor:
    """The loss of a module whose ``forward(x, y)`` returns ``(logits, loss)``."""
    return module(*batch)[1]


def held_out_loss(module: nn.Module, batches: Sequence[Batch]) -> float:
    """Mean loss (nats per token) over every window of ``batches``, in eval mode."""
    total, windows = 0.0, 0
    module.eval()
    with torch.no_grad():
        for batch in batches:
            total += float(tiny_loss(module, batch)) * batch[0].shape[0]
            windows += batch[0].shape[0]
    return total / windows


def probe_rows(batches: Sequence[Batch], windows: int = PROBE_WINDOWS) -> Batch:
    """The probe rows: the first ``windows`` held-out windows as one batch."""
    x = torch.cat([b[0] for b in batches])[:windows]
    y = torch.cat([b[1] for b in batches])[:windows]
    return x, y


def measure_held_out(
    module: nn.Module, batches: Sequence[Batch], *, norm_batches: int | None = None,
    invariance: bool = True, labels: dict[str, str] | None = None,
) -> Measurement:
    """Measure ``module`` on the held-out ``batches`` (see the module docstring).

    ``norm_batches``: how many batches the per-row norm statistics use (all when None);
    ``labels``: the residual-stream point each norm reads, for the ladder (optional).
    """
    module.eval()
    norms = find_norms(module)
    val_loss = held_out_loss(module, batches)
    norm_set = list(batches if norm_batches is None else batches[:norm_batches])
    rows = measure_norm_rows(module, norm_set, tiny_loss, norms)
    ladder, attenuation, growth = sigma_ladder(rows, labels)
    probe = probe_rows(batches)
    inv = final_norm_invariance(module, probe, norms=norms) if invariance else None
    return Measurement(
        norms=norms, val_loss=val_loss,
        windows={"loss": sum(b[0].shape[0] for b in batches), "norms": sum(b[0].shape[0] for b in norm_set),
                 "invariance": int(probe[0].shape[0]) if invariance else 0},
        rows=rows, shares=share_table(rows), ladder=ladder, attenuation=attenuation, growth=growth,
        invariance=inv,
    )
