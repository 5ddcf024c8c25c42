"""Rows that several processes hold alike, counted once.

Under tensor parallelism the ranks of one tensor-parallel group run the same batch: a norm
whose input is replicated across the group (``Replicate()``, or a plain tensor between
``RowwiseParallel`` and ``ColwiseParallel`` without sequence parallelism) gives every rank of
the group the same rows, while a sequence-parallel norm (``Shard(1)``) or a QK-norm over a
rank's own heads gives each rank rows of its own, and data-parallel ranks hold different
batches.  Rather than trusting names of mesh dimensions, the step vector of each process carries
a fingerprint of each norm's rows (:func:`fingerprints`: a float64 sum of every row's
statistics, the same bits on ranks that hold the same rows, computed in the same order);
:func:`drop_replicas` keeps a norm's part of a process's vector only when no earlier process
has the same fingerprint.  So replicated rows count once, sharded rows add up across the whole
mesh, and a step merges as one process would have measured its global batch.  The reduction is
deterministic (a cumulative sum and a matrix product, no atomics), so replicas agree to the bit
on a GPU too.  Two processes whose batches are the same rows (a data loader that gives every
data-parallel rank the same batch) count them once as well.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["drop_replicas", "fingerprints"]


def fingerprints(data: Tensor, counts: Sequence[int], norms: Sequence[int], n_norms: int) -> Tensor:
    """A float64 ``(n_norms,)`` fingerprint of the rows ``data`` (``(fields, rows)`` float32,
    the calls one after the other, ``counts[i]`` rows of norm ``norms[i]``): per norm, the sum
    over its rows of every finite field (nan and inf read as 0), summed call by call in the
    order given; 0 for a norm without rows."""
    per_row = torch.nan_to_num(data.double(), nan=0.0, posinf=0.0, neginf=0.0).sum(0)
    ends = list(itertools.accumulate(counts))
    at = torch.tensor([e - 1 for e in ends], dtype=torch.long, device=data.device)
    cumulative = per_row.cumsum(0)[at]
    per_call = torch.diff(cumulative, prepend=cumulative.new_zeros(1))
    which = torch.zeros(len(counts), n_norms, dtype=torch.float64)
    which[range(len(counts)), list(norms)] = 1.0
    return per_call @ which.to(data.device)


def drop_replicas(gathered: Tensor, n_norms: int, hist_end: int, sum_end: int, max_end: int) -> Tensor:
    """``gathered`` (``(processes, size)`` step vectors, :class:`~lnmonitor.core.maths.histograms.Layout`)
    with each norm's histograms and sums zeroed, and its maxima set to ``-inf``, in every
    process whose fingerprint of that norm equals an earlier process's (compared bit for bit;
    a fingerprint of 0 is none)."""
    p = gathered.shape[0]
    bits = gathered[:, max_end:].contiguous().view(torch.int32).reshape(p, n_norms, 2)
    same = (bits[:, None] == bits[None, :]).all(-1)  # (p, p, n): process i holds what j holds
    earlier = torch.ones(p, p, dtype=torch.bool, device=bits.device).tril(-1)  # j < i
    given = bits.ne(0).any(-1)  # a fingerprint of 0 was not computed (or the norm had no rows)
    replica = (same & earlier[..., None]).any(1) & given  # (p, n)
    keep = (~replica).to(gathered.dtype)
    out = gathered.clone()
    out[:, :hist_end].view(p, n_norms, -1).mul_(keep[..., None])
    out[:, hist_end:sum_end].view(p, n_norms, -1).mul_(keep[..., None])
    out[:, sum_end:max_end].view(p, -1, n_norms).masked_fill_(replica[:, None, :], -math.inf)
    return out
