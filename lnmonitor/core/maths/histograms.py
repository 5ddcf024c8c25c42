"""Mergeable fixed-bin histograms: the flat float32 vector of one measured step.

A step's rows (see :mod:`lnmonitor.core.meter.taps`) become one flat float32 vector per process
(:func:`lnmonitor.core.meter.row_stats.histogram_rows`), laid out by :class:`Layout`:

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
  the gradient that goes around the norm, :attr:`~lnmonitor.core.meter.row_stats.RowStats.bypass`),
  the padding rows the batch's row mask left out, and the rows with a finite input that
  carry no gradient (zero or rounding-level ``|w|``, as at a position without a target),
  counted in the same ``index_add_`` as the histograms;
* per norm, the exact maximum share, and the lowest and highest occupied bin of the
  ``var`` and ``ms`` histograms (so that reading them touches only the occupied span).

Counts are exact up to 2^24 rows per bin per process and step.  Two vectors merge by
adding the histogram and sum part and taking the maximum of the max part, so across
processes a step is all-reduced (:mod:`lnmonitor.core.meter.processes`): the maxima first,
which say which bins any process occupies (:func:`occupied`), then those bins and the sums
alone, a fixed amount per rank whatever the number of processes.  The vector ends with a
fingerprint of each norm's rows (:mod:`lnmonitor.core.maths.replicas`), so that rows several
processes hold alike (tensor parallelism's replicated activations) count once.
:func:`hist_quantile` and :func:`hist_quantiles` read quantiles from the bins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Layout",
    "N_MAX",
    "N_SUMS",
    "SHARE_BINS",
    "SHARE_RESOLUTION",
    "SIGMA_RESOLUTION",
    "VALUE_BINS",
    "VALUE_SHIFT",
    "VAR_RESOLUTION",
    "bin_edges",
    "hist_quantile",
    "hist_quantiles",
    "occupied",
    "stack_histograms",
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
        """Bin edges of the var/ms histograms: the float32 values whose bits are ``i << 16``
        (the bins of inf and nan read as inf)."""
        first_inf = 0xFF << (23 - VALUE_SHIFT)  # exponent 255: inf and nan
        index = np.minimum(np.arange(self.value_bins + 1, dtype=np.int64), first_inf)
        return (index << VALUE_SHIFT).astype(np.uint32).view(np.float32).astype(np.float64)


def occupied(maxima: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """The positions in a step vector of every bin that may hold a row, given the maxima
    (``(N_MAX, n_norms)``, the vector's max part merged over every process), norm after norm,
    then every sum; and where each norm's bins start among them (``n_norms + 1`` offsets).  Per
    norm: the share bins up to its maximum's and the ``var`` and ``ms`` bins between the lowest
    and highest occupied.  Every other histogram bin is zero in every process's vector, so
    adding these positions alone adds the vectors."""
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


def _batched_searchsorted(cum: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row ``i``: the first index ``j`` with ``cum[i, j] >= values[i, :]`` (rows of
    ``cum`` non-decreasing and non-negative), by one flat search over shifted rows."""
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
    """:func:`hist_quantile` for many histograms at once (vectorised over rows):
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
    """Histograms of different spans as the rows of one ``(counts, edges)`` pair for
    :func:`hist_quantiles`: each part is ``(counts (n_i, bins_i), edges (bins_i + 1,))``; the
    narrower ones are padded on the right with empty bins (their last edge repeated), which no
    quantile reads."""
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


_EDGES: dict = {}


def bin_edges(layout: Layout, which: str) -> np.ndarray:
    """The bin edges of ``layout``'s ``"share"`` or value histograms, computed once."""
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
