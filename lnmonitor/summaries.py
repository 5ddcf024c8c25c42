"""Layer 3: mergeable per-norm summaries of one measured step.

A step's rows (see :mod:`lnmonitor.taps`) become one flat float32 vector per process,
laid out by :class:`Layout`:

* per norm, fixed-bin histograms (counts):

  - the dead-plane share: ``SHARE_BINS`` = 4096 linear bins on [0, 1], so a share
    quantile is resolved to ``SHARE_RESOLUTION`` = 1/4096 = 2.4e-4;
  - the norm's variance ``var`` (layer: ``mean((x-mu)^2)``; rms: ``mean(x^2)``) and the
    stream's mean square ``ms = mean(x^2)``: ``LOG_BINS_PER_DECADE`` = 400 log-spaced
    bins per decade on [1e-10, 1e10] (out-of-range rows go to the end bins, and the
    exact minimum and maximum are kept), a relative resolution of
    ``VAR_RESOLUTION`` = 10^(1/400) - 1 = 0.58% on ``var`` and ``eps/var``, half that
    (0.29%, ``SIGMA_RESOLUTION``) on ``sigma = sqrt(var + eps)``, ``1/sigma`` and
    ``rms = sqrt(ms)``.  Quantiles of sigma, 1/sigma, eps/var and the transmission
    ``eps/(var+eps)`` are read from the ``var`` histogram, since each is a monotone
    function of ``var`` (the median of sigma is ``sqrt(median(var) + eps)``).

* per norm, sums: rows seen, sum and sum of squares of the share;
* per norm, maxima: share max, var max, ms max, -var min, -ms min (exact).

Counts are exact up to 2^24 rows per bin per process and step.  Two vectors merge by
adding the histogram and sum part and taking the maximum of the max part
(:func:`merge`), so across DDP ranks the whole step is reduced with one
``all_gather`` of this vector followed by a local sum/max.  The host sees the result
once per logging step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lnmonitor.taps import StepRows

__all__ = [
    "LOG_BINS_PER_DECADE",
    "Layout",
    "NormSummary",
    "SHARE_BINS",
    "SHARE_RESOLUTION",
    "SIGMA_RESOLUTION",
    "VAR_RESOLUTION",
    "hist_quantile",
    "merge",
    "read",
    "row_values",
    "summarise",
]

SHARE_BINS = 4096
LOG_LO, LOG_HI = -10.0, 10.0
LOG_BINS_PER_DECADE = 400
SHARE_RESOLUTION = 1.0 / SHARE_BINS
VAR_RESOLUTION = 10 ** (1.0 / LOG_BINS_PER_DECADE) - 1.0
SIGMA_RESOLUTION = math.sqrt(1.0 + VAR_RESOLUTION) - 1.0

N_SUMS = 3  # rows, share sum, share sum of squares
N_MAX = 5  # share max, var max, ms max, -var min, -ms min


@dataclass(frozen=True)
class Layout:
    """Where each part of a step's flat summary vector lives, for ``n_norms`` norms."""

    n_norms: int
    share_bins: int = SHARE_BINS
    log_lo: float = LOG_LO
    log_hi: float = LOG_HI
    per_decade: int = LOG_BINS_PER_DECADE

    @property
    def log_bins(self) -> int:
        return int(round((self.log_hi - self.log_lo) * self.per_decade))

    @property
    def per_norm(self) -> int:
        return self.share_bins + 2 * self.log_bins

    @property
    def hist_size(self) -> int:
        return self.n_norms * self.per_norm

    @property
    def sum_end(self) -> int:
        """End of the part that merges by addition (histograms, then sums)."""
        return self.hist_size + self.n_norms * N_SUMS

    @property
    def size(self) -> int:
        return self.sum_end + self.n_norms * N_MAX

    def share_edges(self) -> np.ndarray:
        return np.linspace(0.0, 1.0, self.share_bins + 1)

    def log_edges(self) -> np.ndarray:
        """Bin edges of the var/ms histograms in log10 units."""
        return np.linspace(self.log_lo, self.log_hi, self.log_bins + 1)


def _to_device(values: list, device: torch.device) -> Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def row_values(
    data: Tensor, d: Tensor | float, layer: Tensor | float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-row ``(share, share_ok, var, ms, stat_ok)`` from the ``(5, rows)`` reductions of
    :func:`lnmonitor.taps.row_reductions`; ``d`` is the width and ``layer`` 1.0 for
    LayerNorm rows and 0.0 for RMSNorm rows (scalars or per-row tensors).

    ``share^2 = (layer * sw^2 / d + wx^2 / (d var)) / ww``; ``stat_ok`` marks rows with a
    finite, positive ``var`` and ``ms``; ``share_ok`` additionally a finite, non-zero
    ``w``.  ``share`` is 0 where not ``share_ok``.
    """
    var, ms, sw, ww, wx = data.unbind(0)
    stat_ok = torch.isfinite(var) & (var > 0) & torch.isfinite(ms) & (ms > 0)
    share2 = (layer * sw * sw / d + wx * wx / (d * var)) / ww
    share_ok = stat_ok & torch.isfinite(share2) & torch.isfinite(ww) & (ww > 0)
    share = torch.where(share_ok, share2, 0.0).clamp_(0.0, 1.0).sqrt_()
    return share, share_ok, var, ms, stat_ok


def summarise(rows: StepRows, layout: Layout, device: torch.device | str) -> Tensor:
    """The flat float32 summary vector of one process's rows, on ``device``, no host sync."""
    device = torch.device(device)
    n = layout.n_norms
    if rows.data is None or rows.data.shape[1] == 0:
        out = torch.zeros(layout.size, dtype=torch.float32, device=device)
        out[layout.sum_end :] = -math.inf
        return out
    data = rows.data
    device = data.device
    m = data.shape[1]
    counts = [r[1] for r in rows.records]
    consts = _to_device([[r[0], r[2], r[3], float(r[4] == 2)] for r in rows.records], device)
    if len(counts) == 1:
        per_row = consts.expand(m, 4)
    else:
        reps = _to_device(counts, device).long()
        per_row = torch.repeat_interleave(consts, reps, dim=0, output_size=m)
    nid = per_row[:, 0].long()
    share, share_ok, var, ms, stat_ok = row_values(data, per_row[:, 1], per_row[:, 3])

    one = torch.ones((), dtype=var.dtype, device=device)
    base = nid * layout.per_norm
    dump = layout.hist_size
    sb, lb = layout.share_bins, layout.log_bins
    i_share = (share * sb).long().clamp_(0, sb - 1)
    lvar = torch.where(stat_ok, var, one).log10_().sub_(layout.log_lo).mul_(layout.per_decade)
    lms = torch.where(stat_ok, ms, one).log10_().sub_(layout.log_lo).mul_(layout.per_decade)
    i_var = lvar.floor_().clamp_(0, lb - 1).long()
    i_ms = lms.floor_().clamp_(0, lb - 1).long()
    index = torch.cat(
        (
            torch.where(share_ok, base + i_share, dump),
            torch.where(stat_ok, base + sb + i_var, dump),
            torch.where(stat_ok, base + sb + lb + i_ms, dump),
        )
    )
    if device.type == "cpu":
        hist = torch.bincount(index, minlength=layout.hist_size + 1).to(torch.float32)
    else:  # bincount synchronises on accelerators (it needs the max); index_add_ does not
        hist = torch.zeros(layout.hist_size + 1, dtype=torch.float32, device=device)
        hist.index_add_(0, index, torch.ones_like(index, dtype=torch.float32))

    per_norm_rows = [0.0] * n
    for r in rows.records:
        per_norm_rows[r[0]] += r[1]
    sums = torch.zeros(n, N_SUMS, dtype=torch.float32, device=device)
    sums[:, 0] = _to_device(per_norm_rows, device)
    sums[:, 1:].index_add_(0, nid, torch.stack((share, share * share), dim=1))

    ninf = torch.full((), -math.inf, dtype=var.dtype, device=device)
    vals = torch.stack(
        (
            torch.where(share_ok, share, ninf),
            torch.where(stat_ok, var, ninf),
            torch.where(stat_ok, ms, ninf),
            torch.where(stat_ok, -var, ninf),
            torch.where(stat_ok, -ms, ninf),
        ),
        dim=1,
    )
    maxes = torch.full((n, N_MAX), -math.inf, dtype=torch.float32, device=device)
    maxes.scatter_reduce_(0, nid.unsqueeze(1).expand(m, N_MAX), vals, "amax", include_self=True)
    return torch.cat((hist[:-1], sums.flatten(), maxes.flatten()))


def merge(gathered: Tensor | np.ndarray, layout: Layout) -> np.ndarray:
    """Merge summary vectors stacked as ``(processes, size)`` (or one ``(size,)``) into
    one float64 vector: histograms and sums add, maxima take the maximum."""
    if isinstance(gathered, Tensor):
        gathered = gathered.detach().cpu().double().numpy()
    g = np.asarray(gathered, dtype=np.float64)
    if g.ndim == 1:
        g = g[None]
    if g.shape[-1] != layout.size:
        raise ValueError(f"summary vectors have {g.shape[-1]} entries, the layout {layout.size}")
    g = g.reshape(-1, layout.size)
    return np.concatenate((g[:, : layout.sum_end].sum(0), g[:, layout.sum_end :].max(0)))


def hist_quantile(
    counts: np.ndarray,
    edges: np.ndarray,
    q: float,
    lo: float = -math.inf,
    hi: float = math.inf,
    log: bool = False,
) -> float:
    """Quantile ``q`` of the values binned in ``counts`` (bin ``i`` is ``edges[i]..edges[i+1]``,
    in log10 units when ``log``).

    Same definition as numpy's default: linear interpolation between the order statistics
    around the 0-based rank ``q (n - 1)``.  Each order statistic is placed inside its bin
    as if the bin's values were evenly spread across it and clamped to ``[lo, hi]`` (the
    exact extremes), so the error is at most one bin width (relative, for log bins).
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
        value = edges[i] + min(max(frac, 0.0), 1.0) * (edges[i + 1] - edges[i])
        if log:
            value = 10.0**value
        return min(max(value, lo), hi)

    low = order_stat(r0)
    return float(low if t == 0 or r1 == r0 else (1 - t) * low + t * order_stat(r1))


@dataclass
class NormSummary:
    """The merged statistics of one norm for one step (all ranks, all micro-batches)."""

    rows: int
    measured_rows: int
    share_rows: int
    share_counts: np.ndarray
    var_counts: np.ndarray
    ms_counts: np.ndarray
    share_sum: float
    share_sq_sum: float
    share_max: float
    var_min: float
    var_max: float
    ms_min: float
    ms_max: float
    layout: Layout

    @property
    def skipped_rows(self) -> int:
        """Rows without a share: zero or non-finite gradient or input, constant row."""
        return self.rows - self.share_rows

    def share_quantile(self, q: float) -> float:
        return hist_quantile(self.share_counts, self.layout.share_edges(), q, 0.0, self.share_max)

    def var_quantile(self, q: float) -> float:
        if not self.measured_rows:
            return math.nan
        return hist_quantile(
            self.var_counts, self.layout.log_edges(), q, self.var_min, self.var_max, log=True
        )

    def ms_quantile(self, q: float) -> float:
        if not self.measured_rows:
            return math.nan
        return hist_quantile(
            self.ms_counts, self.layout.log_edges(), q, self.ms_min, self.ms_max, log=True
        )

    @property
    def share_mean(self) -> float:
        return self.share_sum / self.share_rows if self.share_rows else math.nan


def read(merged: np.ndarray, layout: Layout) -> list[NormSummary]:
    """Split a merged vector (see :func:`merge`) into one :class:`NormSummary` per norm."""
    n = layout.n_norms
    hist = merged[: layout.hist_size].reshape(n, layout.per_norm)
    sums = merged[layout.hist_size : layout.sum_end].reshape(n, N_SUMS)
    maxes = merged[layout.sum_end :].reshape(n, N_MAX)
    sb, lb = layout.share_bins, layout.log_bins
    out = []
    for i in range(n):
        share_counts = hist[i, :sb]
        var_counts = hist[i, sb : sb + lb]
        share_max = float(maxes[i, 0])
        out.append(
            NormSummary(
                rows=int(round(sums[i, 0])),
                measured_rows=int(round(var_counts.sum())),
                share_rows=int(round(share_counts.sum())),
                share_counts=share_counts,
                var_counts=var_counts,
                ms_counts=hist[i, sb + lb :],
                share_sum=float(sums[i, 1]),
                share_sq_sum=float(sums[i, 2]),
                share_max=share_max if math.isfinite(share_max) else math.nan,
                var_min=float(-maxes[i, 3]),
                var_max=float(maxes[i, 1]),
                ms_min=float(-maxes[i, 4]),
                ms_max=float(maxes[i, 2]),
                layout=layout,
            )
        )
    return out
