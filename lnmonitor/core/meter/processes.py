"""A measured step merged over every process, at a cost per rank that does not grow with their number.

Each process holds its step vector (:class:`~lnmonitor.core.maths.histograms.Layout`); every
process calls :func:`merge_processes` together, and three collectives of the default process
group leave each of them the vector one process would have built from every process's rows:

1. the rows' fingerprints, ``n_norms`` float64 a process, all-gathered: a norm whose rows an
   earlier process holds alike (tensor parallelism's replicated activations) is left out of
   what this process sends (:func:`~lnmonitor.core.maths.replicas.replicated`).  The only part
   that grows with the number of processes P: 8 bytes a norm and a process;
2. the maxima (``N_MAX`` a norm), all-reduced by maximum: the exact extremes, and which bins
   of each histogram any process occupies;
3. those bins and the sums (:func:`~lnmonitor.core.maths.histograms.occupied`), packed and
   all-reduced by sum, then put back in place.

No process holds another's vector, so a rank allocates, sends and receives what its own
vector's occupied bins take, at 2 processes or 16,384 (docs/performance.md, "Past one
machine", has the measured bytes and the cost model).  The counts are integers below 2^24, so
the merged histograms are exact whatever order the reduction adds them in.  The maxima come to
the host once, to pack the bins: with :func:`~lnmonitor.core.meter.row_stats.read`'s copy, a
merged step syncs twice.

:class:`StepMaximum` gives every process the maximum of one number a step (the every-step
growth's), so that a finding and a stop are the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch import distributed as dist

from lnmonitor.core.maths.histograms import N_SUMS, Layout, occupied
from lnmonitor.core.maths.replicas import replicated

__all__ = ["StepMaximum", "merge_processes", "several_processes"]


def several_processes() -> bool:
    """Whether this process is one of several (``torch.distributed`` initialised, world > 1)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def merge_processes(flat: Tensor, layout: Layout) -> Tensor:
    """``flat[: layout.max_end]`` merged over every process of the default group, in place
    (every process must call this together; one process: returned as it is)."""
    if not several_processes():
        return flat[: layout.max_end]
    prints = flat[layout.max_end :].clone().view(torch.float64)  # a copy: float64-aligned
    every = prints.new_empty((dist.get_world_size(), layout.n_norms))
    dist.all_gather(list(every.unbind(0)), prints)
    replicas = replicated(every, dist.get_rank())
    maxima = flat[layout.sum_end : layout.max_end]  # a replica's are its original's: no need to drop
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    at, starts = occupied(maxima.cpu().numpy(), layout)
    index = torch.from_numpy(at).to(flat.device)
    packed = flat[index]
    sums = starts[-1]  # the sums follow the bins, N_SUMS a norm
    for norm in torch.nonzero(replicas).flatten().tolist():  # sent as zeros: counted once
        packed[starts[norm] : starts[norm + 1]] = 0.0
        packed[sums + norm * N_SUMS : sums + (norm + 1) * N_SUMS] = 0.0
    dist.all_reduce(packed)
    flat.index_copy_(0, index, packed)
    return flat[: layout.max_end]


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

