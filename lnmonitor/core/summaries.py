"""Mergeable per-norm summaries of one measured step.

A step's rows (see :mod:`lnmonitor.core.taps`) become one flat float32 vector per process,
laid out by :class:`Layout`:

* per norm, fixed-bin histograms (counts):

  - the dead-plane share: ``SHARE_BINS`` = 4096 linear bins on [0, 1], so a share
    quantile is resolved to ``SHARE_RESOLUTION`` = 1/4096 = 2.4e-4;
  - the norm's variance ``var`` (layer: ``mean((x-mu)^2)``; rms: ``mean(x^2)``) and the
    stream's mean square ``ms = mean(x^2)``, over the *whole* float32 range: a row's bin
    is the top 15 bits of its float32 value (the exponent and 7 mantissa bits,
    ``VALUE_BINS`` = 32,768 bins), so a bin spans at most ``VAR_RESOLUTION`` = 2^-7 =
    0.78% of its value on ``var`` and ``eps/var``, ``SIGMA_RESOLUTION`` = 0.39% on
    ``sigma = sqrt(var + eps)``, ``1/sigma`` and ``rms = sqrt(ms)``, from 1e-38 to 3e38
    alike, and no value is clamped.  Quantiles of sigma, 1/sigma, eps/var and the
    transmission ``eps/(var+eps)`` are read from the ``var`` histogram, since each is a
    monotone function of ``var`` (the median of sigma is ``sqrt(median(var) + eps)``).

* per norm, sums: the rows seen and, on the step that tells residual-stream norms from
  branch norms, ``|dL/dx|^2`` and ``|dL/dx - J^T dL/dy|^2`` at the norm's input (the part of
  the gradient that goes around the norm, :attr:`NormSummary.bypass`), the padding rows
  the batch's row mask left out (:attr:`NormSummary.pad_rows`), and the rows with a finite
  input that carry no gradient (:attr:`NormSummary.zero_grad_rows`: zero or rounding-level
  ``|w|``, as a causal LM's last token, which has no target), counted in the same
  ``index_add_`` as the histograms;
* per norm, the exact maximum share, and the lowest and highest occupied bin of the
  ``var`` and ``ms`` histograms (so that reading them touches only the occupied span).

Counts are exact up to 2^24 rows per bin per process and step.  Two vectors merge by
adding the histogram and sum part and taking the maximum of the max part
(:func:`merge`), so across DDP ranks the whole step is reduced with one
``all_gather`` of this vector followed by a local sum/max on the device.  The vector
ends with a fingerprint of each norm's rows (:mod:`lnmonitor.core.replicas`), so that rows
several processes hold alike (tensor parallelism's replicated activations) count once.  :func:`read`
brings the merged vector to the host (the step's one synchronisation) and reads the
quantiles of all norms at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lnmonitor.core.reductions import row_values
from lnmonitor.core.replicas import drop_replicas, fingerprints
from lnmonitor.core.taps import StepRows

__all__ = [
    "Layout",
    "NormSummary",
    "SHARE_BINS",
    "SHARE_RESOLUTION",
    "SIGMA_RESOLUTION",
    "VALUE_BINS",
    "VAR_RESOLUTION",
    "hist_quantile",
    "hist_quantiles",
    "merge",
    "read",
    "summarise",
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
    """Where each part of a step's flat summary vector lives, for ``n_norms`` norms."""

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
        """Bin edges of the var/ms histograms: the float32 values whose bits are ``i << 16``
        (the bins of inf and nan read as inf)."""
        first_inf = 0xFF << (23 - VALUE_SHIFT)  # exponent 255: inf and nan
        index = np.minimum(np.arange(self.value_bins + 1, dtype=np.int64), first_inf)
        return (index << VALUE_SHIFT).astype(np.uint32).view(np.float32).astype(np.float64)


def _to_device(values: list, device: torch.device) -> Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def summarise(rows: StepRows, layout: Layout, device: torch.device | str,
              fingerprint: bool = False) -> Tensor:
    """The flat float32 summary vector of one process's rows, on ``device`` (the rows' own
    device when there are rows), no host sync.  ``fingerprint``: fill in each norm's
    fingerprint (:func:`~lnmonitor.core.replicas.fingerprints`; zeros otherwise), which
    :func:`merge` needs to count rows held alike by several processes once.

    Few, cheap operators (this runs every measured step): the three histograms take one
    ``index_add_`` whose weight is 1 for a row with a value and 0 for one without (whose index
    still falls inside its norm's histograms), and the five maxima one ``scatter_reduce_``,
    a row without a value giving ``-inf`` there; masks are 0/1 floats, not ``where``.
    """
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
        ids = torch.tensor([r.norm for r in recs], dtype=torch.long)
        reps = torch.tensor(counts, dtype=torch.long)
        if device.type == "cuda":
            ids, reps = ids.pin_memory().to(device, True), reps.pin_memory().to(device, True)
        nid = torch.repeat_interleave(ids.to(device), reps.to(device), output_size=m)
    share, share_ok, _, _, stat_ok = row_values(data, d, layer)

    sb, vb = layout.share_bins, layout.value_bins
    # per row, its share, var and ms bins and whether each counts (1.0) or not (0.0)
    bins = data[:2].view(torch.int32).bitwise_right_shift(VALUE_SHIFT)  # top 15 bits of var, ms
    weight = torch.empty((4, m), dtype=torch.float32, device=device)
    weight[0].copy_(share_ok.view(torch.uint8))
    weight[1:3].copy_(stat_ok.view(torch.uint8).expand(2, m))
    # a row without gradient by construction (exactly or rounding-level zero |w|, finite input:
    # a causal LM's last token) counts in its norm's sum of such rows, not as a fault
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
    sums[:, 0] = _to_device(per_norm_rows, device)
    for index, parts in rows.bypass.items():
        sums[index, 1:3] = parts
    for index, pads in rows.pads.items():
        sums[index, 3] = pads
    if fingerprint:
        prints = fingerprints(data, counts, [r.norm for r in recs], n)
        flat[layout.max_end :].copy_(prints.view(torch.float32))  # the float64 bits, as two float32
    return flat


def merge(gathered: Tensor | np.ndarray, layout: Layout) -> Tensor:
    """Merge summary vectors stacked as ``(processes, size)`` (or one ``(size,)``) into one
    vector of ``layout.max_end`` entries on the same device: histograms and sums add, maxima
    take the maximum, and a norm's rows that a process holds exactly as an earlier one does
    (the same fingerprint: a tensor-parallel rank's replicated activations) count once."""
    g = torch.as_tensor(gathered)
    if g.shape[-1] != layout.size:
        raise ValueError(f"summary vectors have {g.shape[-1]} entries, the layout {layout.size}")
    g = g.reshape(-1, layout.size)
    if g.shape[0] == 1:
        return g[0, : layout.max_end]
    g = drop_replicas(g, layout.n_norms, layout.hist_size, layout.sum_end, layout.max_end)
    return torch.cat((g[:, : layout.sum_end].sum(0), g[:, layout.sum_end : layout.max_end].amax(0)))


def _batched_searchsorted(cum: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row ``i``: the first index ``j`` with ``cum[i, j] >= values[i, :]`` (rows of
    ``cum`` non-decreasing and non-negative), by one flat search over shifted rows."""
    n, width = cum.shape
    total = cum[:, -1:]
    offset = np.concatenate(([0.0], np.cumsum(total[:, 0] + 1.0)[:-1]))[:, None]
    j = np.searchsorted((cum + offset).ravel(), (values + offset).ravel(), side="left")
    return np.clip(j.reshape(values.shape) - (np.arange(n) * width)[:, None], 0, width - 1)


def hist_quantiles(
    counts: np.ndarray,
    edges: np.ndarray,
    qs: Sequence[float],
    lo: np.ndarray,
    hi: np.ndarray,
) -> np.ndarray:
    """:func:`hist_quantile` for many histograms at once (vectorised over rows):
    ``counts`` is ``(n, bins)``, ``edges`` ``(bins + 1,)``, ``lo``/``hi`` ``(n,)``;
    returns ``(n, len(qs))``, nan for empty histograms.  Only the span of bins occupied
    in some row is accumulated."""
    counts = np.asarray(counts)
    n = counts.shape[0]
    cols = np.flatnonzero(counts.any(axis=0))
    if cols.size == 0:
        return np.full((n, len(qs)), np.nan)
    first, stop = int(cols[0]), int(cols[-1]) + 1
    counts = counts[:, first:stop].astype(np.float64)
    edges = np.asarray(edges, dtype=np.float64)[first : stop + 1]
    cum = np.cumsum(counts, axis=1)
    total = cum[:, -1:]
    last = np.maximum(total - 1, 0)
    pos = np.asarray(qs, dtype=np.float64)[None, :] * last
    r0 = np.floor(pos)
    t = pos - r0
    r1 = np.minimum(r0 + 1, last)
    lo, hi = np.asarray(lo, dtype=np.float64)[:, None], np.asarray(hi, dtype=np.float64)[:, None]

    # both order statistics' bins in one search
    i0, i1 = np.split(_batched_searchsorted(cum, np.concatenate((r0, r1), 1) + 0.5), 2, axis=1)

    def order_stat(r: np.ndarray, i: np.ndarray) -> np.ndarray:
        ci = np.take_along_axis(counts, i, 1)
        before = np.take_along_axis(cum, i, 1) - ci
        frac = np.clip((r - before + 0.5) / np.maximum(ci, 1.0), 0.0, 1.0)
        width = edges[i + 1] - edges[i]
        v = edges[i] + frac * np.where(np.isfinite(width), width, 0.0)
        return np.minimum(np.maximum(v, lo), hi)

    v0 = order_stat(r0, i0)
    with np.errstate(invalid="ignore"):
        out = np.where(t > 0, (1 - t) * v0 + t * order_stat(r1, i1), v0)
    return np.where(total > 0, out, np.nan)


_EDGES: dict = {}


def _edges(layout: Layout, which: str) -> np.ndarray:
    key = (layout.share_bins, layout.value_bins, which)
    if key not in _EDGES:
        _EDGES[key] = layout.share_edges() if which == "share" else layout.value_edges()
    return _EDGES[key]


def hist_quantile(
    counts: np.ndarray,
    edges: np.ndarray,
    q: float,
    lo: float = -math.inf,
    hi: float = math.inf,
) -> float:
    """Quantile ``q`` of the values binned in ``counts`` (bin ``i`` is ``edges[i]..edges[i+1]``).

    Same definition as numpy's default: linear interpolation between the order statistics
    around the 0-based rank ``q (n - 1)``.  Each order statistic is placed inside its bin
    as if the bin's values were evenly spread across it and clamped to ``[lo, hi]`` (the
    exact extremes), so the error is at most one bin width.
    """
    counts = np.asarray(counts, dtype=np.float64)
    n = int(round(counts.sum()))
    if n <= 0:
        return math.nan
    cum = np.cumsum(counts)
    pos = q * (n - 1)
    r0 = int(math.floor(pos))
    r1 = min(r0 + 1, n - 1)
    t = pos - r0

    def order_stat(r: int) -> float:
        i = min(int(np.searchsorted(cum, r + 0.5, side="left")), len(counts) - 1)
        before = cum[i] - counts[i]
        frac = (r - before + 0.5) / counts[i] if counts[i] > 0 else 0.5
        width = edges[i + 1] - edges[i]
        value = edges[i] + min(max(frac, 0.0), 1.0) * (width if math.isfinite(width) else 0.0)
        return min(max(value, lo), hi)

    low = order_stat(r0)
    return float(low if t == 0 or r1 == r0 else (1 - t) * low + t * order_stat(r1))


@dataclass
class NormSummary:
    """The merged statistics of one norm for one step (all ranks, all micro-batches).

    Quantiles: ``share_median``, ``share_p90`` (resolution ``SHARE_RESOLUTION``),
    ``var_median`` and ``ms_median`` (relative resolution ``VAR_RESOLUTION``).  The
    histograms themselves (``*_counts``) are present only when read with ``counts=True``;
    then ``share_quantile`` gives any other quantile of the share.
    """

    rows: int
    measured_rows: int
    share_rows: int
    share_median: float
    share_p90: float
    var_median: float
    ms_median: float
    share_max: float
    var_min: float  # lower edge of the lowest occupied var bin
    var_max: float  # upper edge of the highest occupied var bin
    layout: Layout
    bypass: float = math.nan  # |dL/dx - J^T dL/dy| / |dL/dx| at the input, when it was measured
    pad_rows: int = 0  # rows the batch's row mask marks as padding: in no statistic
    zero_grad_rows: int = 0  # rows with a finite input and no gradient (zero or rounding-level |w|)
    share_counts: np.ndarray | None = None
    var_counts: np.ndarray | None = None

    @property
    def skipped_rows(self) -> int:
        """Rows without a share that are faults or cannot be read: a non-finite gradient or
        input, a constant row.  Padding (:attr:`pad_rows`) and rows without gradient by
        construction (:attr:`zero_grad_rows`: a causal LM's last token, a frozen norm) apart."""
        return self.rows - self.pad_rows - self.zero_grad_rows - self.share_rows

    def _need_counts(self) -> None:
        if self.share_counts is None:
            raise ValueError("this summary was read without its histograms: read(..., counts=True)")

    def share_quantile(self, q: float) -> float:
        self._need_counts()
        return hist_quantile(self.share_counts, self.layout.share_edges(), q, 0.0, self.share_max)



def _span(bottom: np.ndarray, top: np.ndarray) -> tuple[int, int]:
    """The bins ``[lo, hi)`` occupied in some norm (``bottom``/``top``: each norm's lowest and
    highest occupied bin, -inf/inf when it has none); ``(0, 0)`` when none is."""
    full = np.isfinite(top)
    if not full.any():
        return 0, 0
    return int(bottom[full].min()), int(top[full].max()) + 1


def _bounds(bottom: np.ndarray, top: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower edge of each norm's lowest occupied bin and upper edge of its highest (linear
    units); nan for a norm without one."""
    full = np.isfinite(top)
    lo = np.where(full, edges[np.where(full, bottom, 0).astype(np.int64)], np.nan)
    hi = np.where(full, edges[np.where(full, top, 0).astype(np.int64) + 1], np.nan)
    return lo, hi


def read(merged: Tensor | np.ndarray, layout: Layout, counts: bool = True) -> list[NormSummary]:
    """One :class:`NormSummary` per norm from a merged vector (see :func:`merge`).

    The vector comes to the host in one transfer (the step's only synchronisation) and
    the quantiles of all norms are read from it at once, vectorised, over the occupied
    span of the value histograms only.  ``counts`` keeps the histograms in the summaries
    (for TensorBoard histograms or other quantiles), as float32 views of the vector.
    """
    if isinstance(merged, Tensor):
        merged = merged.detach().cpu().numpy()
    merged = np.asarray(merged)
    n, sb, lb = layout.n_norms, layout.share_bins, layout.value_bins
    hist = merged[: layout.hist_size].reshape(n, layout.per_norm)
    sums = merged[layout.hist_size : layout.sum_end].reshape(n, N_SUMS).astype(np.float64)
    maxes = merged[layout.sum_end : layout.max_end].reshape(N_MAX, n).astype(np.float64)
    share_c = hist[:, :sb]
    value_edges = _edges(layout, "value")
    var_lo, var_hi = _bounds(-maxes[2], maxes[1], value_edges)
    ms_lo, ms_hi = _bounds(-maxes[4], maxes[3], value_edges)
    (v0, v1), (m0, m1) = _span(-maxes[2], maxes[1]), _span(-maxes[4], maxes[3])
    var_c, ms_c = hist[:, sb + v0 : sb + v1], hist[:, sb + lb + m0 : sb + lb + m1]
    with np.errstate(invalid="ignore", over="ignore"):
        q_share = hist_quantiles(share_c, _edges(layout, "share"), (0.5, 0.9), np.zeros(n), maxes[0])
        q_var = hist_quantiles(var_c, value_edges[v0 : v1 + 1], (0.5,), var_lo, var_hi)
        q_ms = hist_quantiles(ms_c, value_edges[m0 : m1 + 1], (0.5,), ms_lo, ms_hi)
    share_rows = share_c.sum(1, dtype=np.float64)
    var_rows = var_c.sum(1, dtype=np.float64)
    out = []
    for i in range(n):
        share_max = float(maxes[0, i])
        out.append(
            NormSummary(
                rows=int(round(sums[i, 0])),
                measured_rows=int(round(var_rows[i])),
                share_rows=int(round(share_rows[i])),
                share_median=float(q_share[i, 0]),
                share_p90=float(q_share[i, 1]),
                var_median=float(q_var[i, 0]),
                ms_median=float(q_ms[i, 0]),
                share_max=share_max if math.isfinite(share_max) else math.nan,
                var_min=float(var_lo[i]),
                var_max=float(var_hi[i]),
                layout=layout,
                bypass=math.sqrt(sums[i, 2] / sums[i, 1]) if sums[i, 1] > 0 else math.nan,
                pad_rows=int(round(sums[i, 3])),
                zero_grad_rows=int(round(sums[i, 4])),
                share_counts=share_c[i] if counts else None,
                var_counts=hist[i, sb : sb + lb] if counts else None,
            )
        )
    return out
