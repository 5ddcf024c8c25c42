"""The per-norm statistics of one measured step: the rows histogrammed, then read.

:func:`histogram_rows` turns one process's rows (see :mod:`lnmonitor.core.meter.taps`) into the
step's flat float32 vector on the device (laid out by
:class:`~lnmonitor.core.maths.histograms.Layout`, merged across processes by
:func:`~lnmonitor.core.maths.histograms.merge`); :func:`read` brings the merged vector to the host
(the step's one synchronisation) and reads every norm's :class:`RowStats` at once.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from lnmonitor.core.maths.histograms import (
    N_MAX,
    N_SUMS,
    VALUE_SHIFT,
    Layout,
    bin_edges,
    hist_quantile,
    hist_quantiles,
    stack_histograms,
)
from lnmonitor.core.maths.reductions import row_values
from lnmonitor.core.maths.replicas import fingerprints
from lnmonitor.core.meter.taps import StepRows

__all__ = ["RowStats", "count_targets", "histogram_rows", "read"]


def _to_device(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values`` on ``device``: from pinned memory, without waiting, on a CUDA device."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def histogram_rows(rows: StepRows, layout: Layout, device: torch.device | str,
              fingerprint: bool = False) -> Tensor:
    """The flat float32 vector of one process's rows, on ``device`` (the rows' own
    device when there are rows), no host sync.  ``fingerprint``: fill in each norm's
    fingerprint (:func:`~lnmonitor.core.maths.replicas.fingerprints`; zeros otherwise), which
    :func:`~lnmonitor.core.meter.processes.merge_processes` needs to count rows held alike by
    several processes once.

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


@dataclass
class RowStats:
    """The merged statistics of one norm for one step (all ranks, all micro-batches).

    Quantiles: ``share_median``, ``share_p90`` (resolution ``SHARE_RESOLUTION``),
    ``var_median`` and ``ms_median`` (relative resolution ``VAR_RESOLUTION``).  The
    histograms themselves (``*_counts``) are present only when read with ``counts=True``;
    then ``share_quantile`` gives any other quantile of the share.
    """

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
        """Rows without a share that are faults or cannot be read: a non-finite gradient or
        input, a constant row.  Padding (:attr:`pad_rows`) and rows without gradient
        (:attr:`no_grad_rows`: a causal LM's last token, a frozen norm, a collapse) apart."""
        return self.rows - self.pad_rows - self.no_grad_rows - self.share_rows

    @property
    def vanished_grad_rows(self) -> float:
        """Rows without gradient beyond the rows without a target (:attr:`without_target`: where
        the final norm has no gradient either): rows whose position had a target and whose
        gradient vanished, a fault (collapse); nan where no final norm lines up with these rows."""
        if not math.isfinite(self.without_target):
            return math.nan
        return float(max(0.0, self.no_grad_rows - round(self.without_target)))

    @property
    def zero_grad_rows(self) -> int:
        """Rows without gradient because their position has no target
        (``lnmonitor/zero_grad_rows/<norm>``): :attr:`no_grad_rows` less
        :attr:`vanished_grad_rows` (all of them where no final norm lines up)."""
        vanished = self.vanished_grad_rows
        return self.no_grad_rows - (int(vanished) if math.isfinite(vanished) else 0)

    def _need_counts(self) -> None:
        if self.share_counts is None:
            raise ValueError("these statistics were read without its histograms: read(..., counts=True)")

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


def read(merged: Tensor | np.ndarray, layout: Layout, counts: bool = True) -> list[RowStats]:
    """One :class:`RowStats` per norm from a merged vector (see :func:`merge`).

    The vector comes to the host in one transfer (the step's only synchronisation) and
    the quantiles of all norms are read from it at once, vectorised, over the occupied
    span of the value histograms only.  ``counts`` keeps the histograms in the statistics
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
    """``stats`` with each norm's :attr:`RowStats.without_target`, the rows at positions without a
    target.  A final norm's row gets its gradient from its own position's loss alone, so its rows
    without gradient are those positions (a label of -100: a masked prompt, a packing separator,
    padding; a causal LM's last token); norm ``i`` has that many times the rows it has per row of
    its final norm (``final_of[i]``, its stack's; per-head rows: one per head).  A ``frozen``
    norm has no gradient by construction: every row.  nan where no final norm lines up (none, or
    rows that are not a whole multiple of the final norm's)."""
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
