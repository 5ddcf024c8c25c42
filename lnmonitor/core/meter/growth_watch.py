"""Every step's stream growth (last rung's median row rms over the first's, docs/findings.md) for
two reductions: :class:`GrowthWatch` hooks the first and last rung's forward (no backward hook, no
host sync), keeps a step's largest value on the device, and :meth:`GrowthWatch.take` reads it (on
an accelerator through pinned memory, once its event passed).  Forwards without gradient or inside
:func:`~lnmonitor.core.hooks.unmeasured` are not watched.  It is exact and unmasked where the
meter's ``growth`` is read from histograms without padding; of several processes each watches its
own rows and the meter takes the largest (:class:`~lnmonitor.core.meter.processes.StepMaximum`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors
from lnmonitor.core.hooks import Hooks, measuring

__all__ = ["GrowthWatch", "row_rms"]


def row_rms(x: Tensor) -> Tensor:
    """``sqrt`` of the median over rows (every dimension but the last) of ``mean(x**2)`` over
    the last: the rms of the stream a norm reads, as the meter's ``rms`` figure defines it
    (float32, a 0-dim tensor on ``x``'s device; the lower median of an even count)."""
    return _median_row_norm(x).mul_(1.0 / math.sqrt(x.shape[-1]))


def _median_row_norm(x: Tensor) -> Tensor:
    """The median of the rows' Euclidean norms: ``row_rms`` times ``sqrt(width)`` (the square
    root preserves the order), two kernels on every step.  A float64 stream (a probe's float64
    reference) is reduced in float64 and the result rounded to float32."""
    if x.dtype == torch.float64:  # vector_norm refuses to narrow
        return torch.linalg.vector_norm(x.detach(), dim=-1).median().float()
    return torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float32).median()


def _rows(args: tuple) -> Tensor | None:
    """The stream a norm reads, as whole rows: a tensor-parallel ``DTensor``'s local rows (each
    process judges its own; None where a process holds part of every row)."""
    if not (args and isinstance(args[0], Tensor)):
        return None
    stream = args[0]
    if not dtensors.is_dtensor(stream):  # the usual case, checked once on every step's forward
        return stream
    return None if dtensors.unsupported(stream) else stream.to_local()


class GrowthWatch:
    """The every-step growth of one ladder (see the module docstring).

    ``attach(first, last)`` hooks the two rungs until :meth:`detach`; each training forward
    computes the last input's median row norm over the first's on the device and keeps the
    step's largest; :meth:`take` closes a step, applying the widths' ``sqrt`` as a Python float
    (``row_rms(last) / row_rms(first)``, one kernel fewer).
    """

    def __init__(self) -> None:
        self._hooks = Hooks()
        self._first: Tensor | None = None  # this forward's first-rung median row norm, until the last runs
        self._first_width = 0
        self._max: Tensor | None = None  # the step's largest ratio of median row norms so far, on the device
        self._widths = 1.0  # sqrt(first width / last width): the norms' ratio times it is the rms ratio
        self._pending: list[tuple[int, Tensor, object, float]] = []  # accelerator copies on their way
        self.error: Exception | None = None  # why a hook could not read the stream: the watch stops

    def attach(self, first: nn.Module, last: nn.Module) -> None:
        """Watch the ladder from ``first`` to ``last`` (two different modules)."""
        self.detach()
        self.error = None
        self._hooks.forward_pre(first, self._guarded(self._on_first))
        self._hooks.forward_pre(last, self._guarded(self._on_last))

    def detach(self) -> None:
        """Remove the hooks and forget every value not yet taken."""
        self._hooks.remove()
        self._first = self._max = None
        self._pending = []

    def _guarded(self, fn):
        """``fn`` that never raises into the user's forward: the first error is kept in
        :attr:`error`, and the watch reads nothing more (:meth:`take` then removes the hooks)."""

        def hook(module: nn.Module, args: tuple) -> None:
            if self.error is None:
                try:
                    fn(module, args)
                except Exception as err:  # noqa: BLE001 - never stop the user's training
                    self.error = err

        return hook

    def _on_first(self, module: nn.Module, args: tuple) -> None:
        stream = _rows(args)
        if stream is not None and torch.is_grad_enabled() and measuring():
            self._first, self._first_width = _median_row_norm(stream), stream.shape[-1]

    def _on_last(self, module: nn.Module, args: tuple) -> None:
        first, self._first = self._first, None
        stream = _rows(args)
        if first is None or stream is None:
            return
        ratio = _median_row_norm(stream) / first
        self._widths = math.sqrt(self._first_width / stream.shape[-1])  # a Python float, no kernel
        self._max = ratio if self._max is None else torch.maximum(self._max, ratio)

    def _close(self) -> Tensor | None:
        value, self._max, self._first = self._max, None, None
        return value

    def close(self) -> Tensor | None:
        """Close a step without reading it: its growth as a 0-dim tensor on the device (the
        widths applied there), or None (no training forward ran through both rungs since)."""
        value = self._close()
        return None if value is None else value * self._widths

    def take(self, step: int) -> tuple[int, float] | None:
        """Close step ``step``: ``(step, growth)`` of the latest step whose value has reached the
        host (this one on the CPU, an earlier one on an accelerator), or None when there is none
        (no training forward ran through both rungs since the last take, or a copy is still on
        its way; or after a hook's :attr:`error`, which removes the hooks)."""
        if self.error is not None:
            self.detach()
            return None
        value = self._close()
        if value is not None:
            if value.device.type == "cpu":
                return step, float(value) * self._widths
            host = torch.empty((), dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((step, host, event, self._widths))
        arrived = None
        while self._pending and self._pending[0][2].query():
            done, host, _, widths = self._pending.pop(0)
            arrived = (done, float(host) * widths)
        return arrived

