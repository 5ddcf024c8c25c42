"""One number a step, its maximum over every process (:class:`StepMaximum`), so that a finding
and a stop are the same on every rank; and whether this process is one of several."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch import distributed as dist

__all__ = ["StepMaximum", "several_processes"]


def several_processes() -> bool:
    """Whether this process is one of several (``torch.distributed`` initialised, world > 1)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StepMaximum:
    """A number every optimizer step, its maximum over every process.

    Every process calls :meth:`close` at the end of every step, in the same order: one
    all-reduce by maximum of the step's value and a stop flag (8 bytes a process and step,
    docs/performance.md).  On the CPU (gloo) it is read at once; on a GPU the reduction is
    queued on the collective's stream and the host reads a pinned copy of it one step later,
    without waiting for the stream.  So every process reads the same maximum at the same step,
    and all stop together at the step the first asks to (on a GPU, the step after).  No
    collective is left in flight between two calls.  ``across=False``: this process's value
    alone, no collective (the same reading: at once on the CPU, a step later on a GPU).
    """

    def __init__(self, across: bool = True) -> None:
        self._pending: tuple[int, Tensor, Callable[[], object]] | None = None  # a GPU's copy
        self.stopped = False
        self.across = across

    def close(self, step: int, value: Tensor | None, stop: bool,
              device: torch.device) -> tuple[int, float] | None:
        """Close ``step`` with ``value`` (a 0-dim tensor, or None: nothing this step) and
        ``stop`` (this process will send nothing more); ``(step, maximum)`` of the step read
        (None: none, or nothing was sent that step by any process)."""
        read = self._read()
        if self.stopped:
            return read
        sent = torch.full((2,), -math.inf, device=device)  # filled on the device: no host copy
        if stop:
            sent[1] = 1.0
        elif value is not None:
            sent[0] = value
        if self.across:
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)  # on a GPU the current stream waits, not the host
        if not sent.is_cuda:
            return self._take(step, sent)
        host = torch.empty(2, pin_memory=True)
        host.copy_(sent, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (step, host, event.synchronize)
        return read

    def _read(self) -> tuple[int, float] | None:
        """A GPU's copy of the previous step, once its event has passed."""
        if self._pending is None:
            return None
        (step, values, wait), self._pending = self._pending, None
        wait()
        return self._take(step, values)

    def _take(self, step: int, values: Tensor) -> tuple[int, float] | None:
        maximum, stop = values.tolist()
        self.stopped = stop > 0
        return (step, maximum) if math.isfinite(maximum) else None

    def finish(self) -> None:
        """The end of training: nothing more is sent, and a GPU's last copy is waited for."""
        self._read()
        self.stopped = True

