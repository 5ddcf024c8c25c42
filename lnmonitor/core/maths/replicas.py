"""Rows that several processes hold alike, counted once.

Under tensor parallelism the ranks of one tensor-parallel group run the same batch: a norm
whose input is replicated across the group (``Replicate()``, or a plain tensor between
``RowwiseParallel`` and ``ColwiseParallel`` without sequence parallelism) gives every rank of
the group the same rows, while a sequence-parallel norm (``Shard(1)``) or a QK-norm over a
rank's own heads gives each rank rows of its own, and data-parallel ranks hold different
batches.  Rather than trusting names of mesh dimensions, the step vector of each process carries
a fingerprint of each norm's rows (:func:`fingerprints`: a float64 sum of every row's
statistics, the same bits on ranks that hold the same rows, computed in the same order);
:func:`replicated` tells a process which of its norms an earlier process holds alike (the
same fingerprint), and those it leaves out of the merge.  So replicated rows count once,
sharded rows add up across the whole mesh, and a step merges as one process would have
measured its global batch.  The fingerprint's reduction is deterministic (a cumulative sum and
a matrix product, no atomics), so replicas agree to the bit on a GPU too.  Two processes whose
batches are the same rows (a data loader that gives every data-parallel rank the same batch)
count them once as well.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["fingerprints", "replicated"]


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


def replicated(prints: Tensor, rank: int) -> Tensor:
    """Which norms of process ``rank`` an earlier process holds alike: ``prints`` is every
    process's fingerprints, ``(processes, n_norms)`` float64 (:func:`fingerprints`), compared
    bit for bit; a fingerprint of 0 is none (not computed, or no rows).  ``(n_norms,)`` bool."""
    bits = prints.contiguous().view(torch.int64)
    mine = bits[rank]
    return (bits[:rank] == mine).any(0) & mine.ne(0)
