"""Held-out batches through the meter: :func:`held_out_result` runs every batch's forward and
backward inside one :meth:`LadderMeter.step <lnmonitor.core.meter.meter.LadderMeter.step>` and
returns its :class:`~lnmonitor.core.meter.meter.LadderResult`, so ``analyze``, ``eps-compare`` and
the reports log, to the bit, what a monitor would on the same rows.  The model is left as it was
(eval mode during the passes, the RNG forked, ``.grad`` put back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from lnmonitor.core.hooks import eval_mode
from lnmonitor.core.meter.meter import LadderMeter, LadderResult

__all__ = ["held_out_result"]

LossFn = Callable[[nn.Module, object], Tensor]


@contextlib.contextmanager
def _grads_kept(model: nn.Module):
    """Every parameter's ``.grad`` set aside for the duration (None inside), then put back."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad


def held_out_result(
    meter: LadderMeter, batches: Iterable, loss_fn: LossFn, *, counts: bool = False,
    label: str = "the held-out batches",
) -> LadderResult:
    """One measured step of ``meter`` over the held-out ``batches``; its result.

    ``loss_fn(model, batch)`` returns the batch's scalar loss (the tiny GPT's:
    ``lambda m, b: m(*b)[1]``); its backward runs inside the step and the gradients are
    discarded.  ``counts`` keeps the row statistics' histograms (e.g. the share histograms the
    analysis figures draw).  A fresh meter assigns the roles from these passes, as a
    monitor's does on its first measured step.

    Raises:
        ValueError: ``loss_fn`` gave no scalar loss with a graph, or the meter measured
            nothing (it says why: :attr:`LadderMeter.off_reason`, or no norm ran).
    """
    model = meter.model
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with (eval_mode(model), torch.random.fork_rng(devices=devices), _grads_kept(model),
          torch.inference_mode(False), torch.enable_grad(), meter.step()):
        for batch in batches:
            loss = loss_fn(model, batch)
            if not isinstance(loss, Tensor) or loss.ndim != 0 or not loss.requires_grad:
                raise ValueError("loss_fn must return a scalar tensor with a graph (the batch's loss)")
            loss.backward()
    result = meter.result(counts=counts, label=label)
    if result is None:
        why = meter.off_reason or "no selected norm ran with gradient on the held-out batches"
        raise ValueError(f"{meter.name}: nothing was measured: {why}")
    return result
