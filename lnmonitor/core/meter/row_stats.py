"""The step vector: each norm's rows binned into mergeable histograms, merged over processes, read.

One process's rows (:class:`~lnmonitor.core.meter.taps.StepRows`) become one flat float32 vector on
the device (:func:`histogram_rows`, no host sync), laid out by :class:`Layout`, per norm:

* histograms (counts): the dead-plane share in ``SHARE_BINS`` = 4096 linear bins on [0, 1]
  (``SHARE_RESOLUTION`` = 2.4e-4); the input variance ``var`` (RMSNorm: ``mean(x^2)``) and the
  stream's mean square ``ms`` binned by the top 15 bits of their float32 value (``VALUE_BINS`` =
  32,768 bins over the whole float32 range, none clamped), so a bin spans at most
  ``VAR_RESOLUTION`` = 2^-7 of ``var`` and ``eps/var``, ``SIGMA_RESOLUTION`` = 0.39% of sigma,
  1/sigma and rms.  Quantiles of sigma, 1/sigma, eps/var and the transmission are read from the
  ``var`` histogram (each is monotone in ``var``);
* ``N_SUMS`` sums: rows, ``|dL/dx|^2`` and ``|dL/dx - J^T dL/dy|^2`` at the input (on the step that
  finds the roles), padding rows, rows with a finite input and no gradient;
* ``N_MAX`` maxima: the exact largest share, and the highest and lowest occupied ``var`` and
  ``ms`` bins;
* a float64 fingerprint of its rows (:func:`fingerprints`), so that rows several processes hold
  alike (tensor parallelism's replicated activations) count once.

Counts are exact up to 2^24 rows a bin, process and step.  :func:`merge_processes` all-reduces
the vector at a cost per rank that does not grow with the number of processes: the fingerprints
all-gathered (8 bytes a norm and a process), the maxima all-reduced by maximum (they say which
bins any process occupies, :func:`occupied`), then those bins and the sums alone, by sum.
:func:`read` brings the merged vector to the host (the step's one synchronisation; two when
merged) and reads every norm's :class:`RowStats` at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor
from torch import distributed as dist

from lnmonitor.core.maths.reductions import row_values
from lnmonitor.core.meter.processes import several_processes
from lnmonitor.core.meter.taps import StepRows

__all__ = [
    "N_MAX", "N_SUMS", "SHARE_BINS", "SHARE_RESOLUTION", "SIGMA_RESOLUTION", "VALUE_BINS", "VALUE_SHIFT",
    "VAR_RESOLUTION", "Layout", "RowStats", "bin_edges", "count_targets", "fingerprints", "hist_quantiles",
    "histogram_rows", "merge_processes", "occupied", "read", "replicated", "stack_histograms",
]

SHARE_BINS = 4096
SHARE_RESOLUTION = 1.0 / SHARE_BINS
VALUE_MANTISSA_BITS = 7
VALUE_SHIFT = 23 - VALUE_MANTISSA_BITS  # float32 bits dropped: the low mantissa bits
VALUE_BINS = 1 << (31 - VALUE_SHIFT)  # every non-negative float32 bit pattern, 32,768 bins
VAR_RESOLUTION = 2.0**-VALUE_MANTISSA_BITS
SIGMA_RESOLUTION = math.sqrt(1.0 + VAR_RESOLUTION) - 1.0

N_SUMS = 5  # rows, |dL/dx|^2, |dL/dx - J^T dL/dy|^2, padding rows, rows without gradient
N_MAX = 5  # share max; top var bin, -(bottom var bin), top ms bin, -(bottom ms bin): merged by max


@dataclass(frozen=True)
class Layout:
    """Where each part of a step's flat vector lives, for ``n_norms`` norms."""

    n_norms: int
    share_bins: int = SHARE_BINS
    value_bins: int = VALUE_BINS

    @property
    def per_norm(self) -> int:
        return self.share_bins + 2 * self.value_bins

    @property
    def hist_size(self) -> int:
        return self.n_norms * self.per_norm

    @property
    def sum_end(self) -> int:
        """End of the part that merges by addition (histograms, then sums)."""
        return self.hist_size + self.n_norms * N_SUMS

    @property
    def max_end(self) -> int:
        """End of the part that merges by maximum (after it: the rows' fingerprints)."""
        return self.sum_end + self.n_norms * N_MAX

    @property
    def size(self) -> int:
        return self.max_end + 2 * self.n_norms  # a float64 fingerprint per norm, as two float32

    def share_edges(self) -> np.ndarray:
        return np.linspace(0.0, 1.0, self.share_bins + 1)

    def value_edges(self) -> np.ndarray:
        """Bin edges of the var/ms histograms: the float32 values whose bits are ``i << 16``."""
        first_inf = 0xFF << (23 - VALUE_SHIFT)  # exponent 255: inf and nan
        index = np.minimum(np.arange(self.value_bins + 1, dtype=np.int64), first_inf)
        return (index << VALUE_SHIFT).astype(np.uint32).view(np.float32).astype(np.float64)


_EDGES: dict = {}


def bin_edges(layout: Layout, which: str) -> np.ndarray:
    """The bin edges of ``layout``'s ``"share"`` or value histograms, computed once."""
    key = (layout.share_bins, layout.value_bins, which)
    if key not in _EDGES:
        _EDGES[key] = layout.share_edges() if which == "share" else layout.value_edges()
    return _EDGES[key]


def fingerprints(data: Tensor, counts: Sequence[int], norms: Sequence[int], n_norms: int) -> Tensor:
    """Per norm, the float64 sum of every finite field of its rows (``data``: the calls one after
    the other, ``counts[i]`` rows of norm ``norms[i]``), deterministic so that processes holding
    the same rows agree to the bit; 0 without rows."""
    per_row = torch.nan_to_num(data.double(), nan=0.0, posinf=0.0, neginf=0.0).sum(0)
    ends = list(itertools.accumulate(counts))
    at = torch.tensor([e - 1 for e in ends], dtype=torch.long, device=data.device)
    cumulative = per_row.cumsum(0)[at]
    per_call = torch.diff(cumulative, prepend=cumulative.new_zeros(1))
    which = torch.zeros(len(counts), n_norms, dtype=torch.float64)
    which[range(len(counts)), list(norms)] = 1.0
    return per_call @ which.to(data.device)


def replicated(prints: Tensor, rank: int) -> Tensor:
    """Which norms of process ``rank`` an earlier process holds alike (``prints``: every process's
    :func:`fingerprints`, compared bit for bit; 0 is none)."""
    bits = prints.contiguous().view(torch.int64)
    mine = bits[rank]
    return (bits[:rank] == mine).any(0) & mine.ne(0)


def _to_device(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values`` on ``device``: from pinned memory, without waiting, on a CUDA device."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def histogram_rows(rows: StepRows, layout: Layout, device: torch.device | str,
              fingerprint: bool = False) -> Tensor:
    """The step vector of one process's rows, on the rows' device, without a host sync (one
    ``index_add_`` for the histograms and sums, one ``scatter_reduce_`` for the maxima; a row
    without a value has weight 0 and maximum ``-inf``).  ``fingerprint``: fill in
    :func:`fingerprints` (for :func:`merge_processes`; zeros otherwise)."""
    n = layout.n_norms
    if rows.data is None or rows.data.shape[1] == 0:
        flat = torch.zeros(layout.size, dtype=torch.float32, device=device)
        flat[layout.sum_end : layout.max_end] = -math.inf
        return flat
    data = rows.data
    device, m = data.device, data.shape[1]
    recs = rows.records
    counts = [r.rows for r in recs]
    if len({(r.width, r.dead_dim) for r in recs}) == 1:  # one width and kind: python scalars
        d, layer = float(recs[0].width), float(recs[0].dead_dim == 2)
    else:
        table = _to_device([[r.width, float(r.dead_dim == 2)] for r in recs], device)
        per = torch.repeat_interleave(table, _to_device(counts, device).long(), dim=0, output_size=m)
        d, layer = per[:, 0], per[:, 1]
    if len(recs) == 1:
        nid = torch.full((m,), recs[0].norm, dtype=torch.long, device=device)
    else:
        ids = _to_device([r.norm for r in recs], device, torch.long)
        nid = torch.repeat_interleave(ids, _to_device(counts, device, torch.long), output_size=m)
    share, share_ok, _, _, stat_ok = row_values(data, d, layer)

    sb, vb = layout.share_bins, layout.value_bins
    # per row, its share, var and ms bins and whether each counts (1.0) or not (0.0)
    bins = data[:2].view(torch.int32).bitwise_right_shift(VALUE_SHIFT)  # top 15 bits of var, ms
    weight = torch.empty((4, m), dtype=torch.float32, device=device)
    weight[0].copy_(share_ok.view(torch.uint8))
    weight[1:3].copy_(stat_ok.view(torch.uint8).expand(2, m))
    # a row without gradient (exactly or rounding-level zero |w|, finite input) counts in its
    # norm's sum of such rows, not as a fault: whether its position had a target is read later
    torch.eq(data[3], 0.0, out=weight[3]).mul_(weight[1])
    index = torch.empty((4, m), dtype=torch.long, device=device)
    index[0].copy_(torch.mul(share, sb).clamp_(max=sb - 1))  # share: 0 where it has none
    index[1:3].copy_(bins)
    index[1].clamp_(min=-sb)  # a negative or nan var's bin (weight 0) stays inside its norm
    index[1].add_(sb)
    index[2].add_(sb + vb)
    index[:3].add_(nid, alpha=layout.per_norm)
    torch.mul(nid, N_SUMS, out=index[3]).add_(layout.hist_size + 4)  # the norm's fifth sum
    flat = torch.zeros(layout.size, dtype=torch.float32, device=device)
    flat.index_add_(0, index.view(-1), weight.view(-1))

    # the maxima: share, top var bin, -(bottom var bin), top ms bin, -(bottom ms bin); a row
    # without a value is capped at -inf (min with -inf, where the others get min with +inf)
    bins_f = bins.float()
    values = torch.stack((share, bins_f[0], bins_f[0].neg(), bins_f[1], bins_f[1].neg()))
    cap = weight[:2].sub(0.5).mul_(math.inf)
    torch.minimum(values[0], cap[0], out=values[0])
    torch.minimum(values[1:], cap[1], out=values[1:])
    maxes = flat[layout.sum_end : layout.max_end].view(N_MAX, n)
    maxes.fill_(-math.inf)
    maxes.scatter_reduce_(1, nid.expand(N_MAX, m), values, "amax")

    per_norm_rows = [0.0] * n
    for r in recs:
        per_norm_rows[r.norm] += r.rows
    sums = flat[layout.hist_size : layout.sum_end].view(n, N_SUMS)
    sums[:, 0] = _to_device(per_norm_rows, device)  # the host's counts in one copy: each norm's rows
    for index, parts in rows.bypass.items():
        sums[index, 1:3] = parts
    for index, pads in rows.pads.items():
        sums[index, 3] = pads
    if fingerprint:
        prints = fingerprints(data, counts, [r.norm for r in recs], n)
        flat[layout.max_end :].copy_(prints.view(torch.float32))  # the float64 bits, as two float32
    return flat


def occupied(maxima: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """The positions of every bin that may hold a row given the merged maxima, norm after norm,
    then the sums, and where each norm's start (every other bin is zero in every process's
    vector, so adding these alone adds the vectors)."""
    maxima = np.asarray(maxima, dtype=np.float64).reshape(N_MAX, layout.n_norms)
    parts, starts = [], [0]
    for norm in range(layout.n_norms):
        base = norm * layout.per_norm
        share_max, var_top, var_bottom, ms_top, ms_bottom = maxima[:, norm]
        spans = []
        if math.isfinite(share_max):  # the share's bin, as histogram_rows takes it, and one more
            spans.append((0, min(int(np.float32(share_max) * np.float32(layout.share_bins)) + 2,
                                 layout.share_bins)))
        for offset, top, bottom in ((layout.share_bins, var_top, var_bottom),
                                    (layout.share_bins + layout.value_bins, ms_top, ms_bottom)):
            if math.isfinite(top):
                spans.append((offset + int(-bottom), offset + int(top) + 1))
        parts.extend(base + np.arange(lo, hi) for lo, hi in spans)
        starts.append(starts[-1] + sum(hi - lo for lo, hi in spans))
    parts.append(np.arange(layout.hist_size, layout.sum_end))
    return np.concatenate(parts), np.asarray(starts)


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


def _batched_searchsorted(cum: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row ``i``: the first ``j`` with ``cum[i, j] >= values[i, :]``, in one flat search."""
    n, width = cum.shape
    total = cum[:, -1:]
    offset = np.concatenate(([0.0], np.cumsum(total[:, 0] + 1.0)[:-1]))[:, None]
    j = np.searchsorted((cum + offset).ravel(), (values + offset).ravel(), side="left")
    j = j.reshape(values.shape) - (np.arange(n) * width)[:, None]
    return np.minimum(np.maximum(j, 0), width - 1)


def hist_quantiles(
    counts: np.ndarray,
    edges: np.ndarray,
    qs: Sequence[float],
    lo: np.ndarray,
    hi: np.ndarray,
) -> np.ndarray:
    """Quantiles ``qs`` of many histograms at once, numpy's default definition (linear interpolation
    between the order statistics around rank ``q (n - 1)``), each order statistic spread evenly
    across its bin and clamped to ``[lo, hi]`` (the exact extremes), so within one bin width:
    ``counts`` is ``(n, bins)``, ``edges`` ``(bins + 1,)`` shared by every row or ``(n, bins + 1)``
    one per row (histograms of different spans read together: :func:`stack_histograms`),
    ``lo``/``hi`` ``(n,)``; returns ``(n, len(qs))``, nan for empty histograms.  Only the span
    of bins occupied in some row is accumulated."""
    counts = np.asarray(counts)
    n = counts.shape[0]
    cols = np.flatnonzero(counts.any(axis=0))
    if cols.size == 0:
        return np.full((n, len(qs)), np.nan)
    first, stop = int(cols[0]), int(cols[-1]) + 1
    counts = counts[:, first:stop].astype(np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    edges = edges[first : stop + 1] if edges.ndim == 1 else edges[:, first : stop + 1]
    cum = np.cumsum(counts, axis=1)
    total = cum[:, -1:]
    last = np.maximum(total - 1, 0)
    pos = np.asarray(qs, dtype=np.float64)[None, :] * last
    r0 = np.floor(pos)
    t = pos - r0
    r1 = np.minimum(r0 + 1, last)
    lo, hi = np.asarray(lo, dtype=np.float64)[:, None], np.asarray(hi, dtype=np.float64)[:, None]
    row = np.arange(n)[:, None]

    # both order statistics' bins in one search
    both = _batched_searchsorted(cum, np.concatenate((r0, r1), 1) + 0.5)
    k = r0.shape[1]

    def order_stat(r: np.ndarray, i: np.ndarray) -> np.ndarray:
        ci = counts[row, i]
        before = cum[row, i] - ci
        frac = np.minimum(np.maximum((r - before + 0.5) / np.maximum(ci, 1.0), 0.0), 1.0)
        bottom, top = (edges[i], edges[i + 1]) if edges.ndim == 1 else (edges[row, i], edges[row, i + 1])
        width = top - bottom
        v = bottom + frac * np.where(np.isfinite(width), width, 0.0)
        return np.minimum(np.maximum(v, lo), hi)

    v0 = order_stat(r0, both[:, :k])
    with np.errstate(invalid="ignore"):
        out = np.where(t > 0, (1 - t) * v0 + t * order_stat(r1, both[:, k:]), v0)
    return np.where(total > 0, out, np.nan)


def stack_histograms(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Histograms of different spans, ``[(counts, edges), ...]``, as one ``(counts, edges)`` pair
    for :func:`hist_quantiles` (the narrower padded with empty bins)."""
    width = max(c.shape[1] for c, _ in parts)
    counts = np.zeros((sum(c.shape[0] for c, _ in parts), width), dtype=np.float64)
    edges = np.empty((counts.shape[0], width + 1), dtype=np.float64)
    at = 0
    for c, e in parts:
        k, bins = c.shape
        counts[at : at + k, :bins] = c
        edges[at : at + k, : bins + 1] = e
        edges[at : at + k, bins + 1 :] = e[-1]
        at += k
    return counts, edges


@dataclass
class RowStats:
    """One norm's statistics in one step, merged over micro-batches and processes: quantiles of
    the share (to ``SHARE_RESOLUTION``) and of ``var`` and ``ms`` (to ``VAR_RESOLUTION`` relative),
    the rows counted, and with ``counts=True`` the histograms."""

    rows: int
    share_rows: int
    share_median: float
    share_p90: float
    var_median: float
    ms_median: float
    share_max: float
    layout: Layout
    bypass: float = math.nan  # |dL/dx - J^T dL/dy| / |dL/dx| at the input, when it was measured
    pad_rows: int = 0  # rows the batch's row mask marks as padding: in no statistic
    no_grad_rows: int = 0  # rows with a finite input and no gradient (zero or rounding-level |w|)
    without_target: float = math.nan  # rows at positions without a target (:func:`count_targets`)
    share_counts: np.ndarray | None = None
    var_counts: np.ndarray | None = None

    @property
    def skipped_rows(self) -> int:
        """Rows without a share that are faults: a non-finite gradient or input, a constant row."""
        return self.rows - self.pad_rows - self.no_grad_rows - self.share_rows

    @property
    def vanished_grad_rows(self) -> float:
        """Rows without gradient at positions that had a target (a collapse); nan where no final
        norm lines up with these rows."""
        if not math.isfinite(self.without_target):
            return math.nan
        return float(max(0.0, self.no_grad_rows - round(self.without_target)))

    @property
    def zero_grad_rows(self) -> int:
        """Rows without gradient because their position has no target."""
        vanished = self.vanished_grad_rows
        return self.no_grad_rows - (int(vanished) if math.isfinite(vanished) else 0)

    def _need_counts(self) -> None:
        if self.share_counts is None:
            raise ValueError("these statistics were read without its histograms: read(..., counts=True)")

    def share_quantile(self, q: float) -> float:
        self._need_counts()
        edges = bin_edges(self.layout, "share")
        return float(hist_quantiles(self.share_counts[None], edges, (q,), [0.0], [self.share_max])[0, 0])


def _span(bottom: np.ndarray, top: np.ndarray) -> tuple[int, int]:
    """The bins ``[lo, hi)`` occupied in some norm; ``(0, 0)`` when none is."""
    full = np.isfinite(top)
    if not full.any():
        return 0, 0
    return int(bottom[full].min()), int(top[full].max()) + 1


def _bounds(bottom: np.ndarray, top: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each norm's lowest and highest occupied value (nan without one)."""
    full = np.isfinite(top)
    lo = np.where(full, edges[np.where(full, bottom, 0).astype(np.int64)], np.nan)
    hi = np.where(full, edges[np.where(full, top, 0).astype(np.int64) + 1], np.nan)
    return lo, hi


def read(merged: Tensor | np.ndarray, layout: Layout, counts: bool = True) -> list[RowStats]:
    """One :class:`RowStats` per norm from a merged vector, brought to the host in one transfer
    and read at once over the occupied spans; ``counts`` keeps the histograms."""
    if isinstance(merged, Tensor):
        merged = merged.detach().cpu().numpy()
    merged = np.asarray(merged)
    n, sb, lb = layout.n_norms, layout.share_bins, layout.value_bins
    hist = merged[: layout.hist_size].reshape(n, layout.per_norm)
    sums = merged[layout.hist_size : layout.sum_end].reshape(n, N_SUMS).astype(np.float64)
    maxes = merged[layout.sum_end : layout.max_end].reshape(N_MAX, n).astype(np.float64)
    share_c = hist[:, :sb]
    value_edges = bin_edges(layout, "value")
    var_lo, var_hi = _bounds(-maxes[2], maxes[1], value_edges)
    ms_lo, ms_hi = _bounds(-maxes[4], maxes[3], value_edges)
    (v0, v1), (m0, m1) = _span(-maxes[2], maxes[1]), _span(-maxes[4], maxes[3])
    var_c, ms_c = hist[:, sb + v0 : sb + v1], hist[:, sb + lb + m0 : sb + lb + m1]
    with np.errstate(invalid="ignore", over="ignore"):
        q_share = hist_quantiles(share_c, bin_edges(layout, "share"), (0.5, 0.9), np.zeros(n), maxes[0])
        # var and ms in one read: their occupied spans are alike (ms = var + mean^2)
        values = stack_histograms([(var_c, value_edges[v0 : v1 + 1]), (ms_c, value_edges[m0 : m1 + 1])])
        q_values = hist_quantiles(*values, (0.5,), np.concatenate((var_lo, ms_lo)),
                                  np.concatenate((var_hi, ms_hi)))
    q_var, q_ms = q_values[:n], q_values[n:]
    share_rows = share_c.sum(1, dtype=np.float64)
    out = []
    for i in range(n):
        share_max = float(maxes[0, i])
        out.append(
            RowStats(
                rows=int(round(sums[i, 0])),
                share_rows=int(round(share_rows[i])),
                share_median=float(q_share[i, 0]),
                share_p90=float(q_share[i, 1]),
                var_median=float(q_var[i, 0]),
                ms_median=float(q_ms[i, 0]),
                share_max=share_max if math.isfinite(share_max) else math.nan,
                layout=layout,
                bypass=math.sqrt(sums[i, 2] / sums[i, 1]) if sums[i, 1] > 0 else math.nan,
                pad_rows=int(round(sums[i, 3])),
                no_grad_rows=int(round(sums[i, 4])),
                share_counts=share_c[i] if counts else None,
                var_counts=hist[i, sb : sb + lb] if counts else None,
            )
        )
    return out


def count_targets(stats: Sequence[RowStats], final_of: Sequence[int | None],
                  frozen: Collection[int] = ()) -> list[RowStats]:
    """``stats`` with :attr:`RowStats.without_target`: a final norm's rows without gradient are the
    positions without a target (its row's gradient comes from its own position alone); norm ``i``
    has as many per row of its final norm ``final_of[i]``; a ``frozen`` norm's are all its rows;
    nan where no final norm lines up."""
    out = []
    for i, (s, final) in enumerate(zip(stats, final_of, strict=True)):
        without = math.nan
        if i in frozen:
            without = float(s.rows - s.pad_rows)
        elif final is not None:
            mine, theirs = s.rows - s.pad_rows, stats[final].rows - stats[final].pad_rows
            if theirs > 0 and mine % theirs == 0:
                without = float(stats[final].no_grad_rows * (mine // theirs))
        out.append(replace(s, without_target=without))
    return out
