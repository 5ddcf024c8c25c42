"""lnmonitor.core.meter.row_stats: the rows histogrammed equal a per-norm reference, read back they
give each norm's medians within a bin, and an empty step reads as nan (merged over processes like
one batch: tests/test_processes.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lnmonitor.core.meter import row_stats as H
from lnmonitor.core.meter import row_stats as R
from lnmonitor.core.meter.taps import StepRows


def test_an_empty_step_reads_as_nan():
    layout = H.Layout(3)
    out = R.histogram_rows(StepRows(None, [], [], {}), layout, "cpu")
    s = R.read(out[: layout.max_end], layout)[1]
    assert s.rows == 0 and math.isnan(s.share_quantile(0.5))
    assert math.isnan(s.var_median) and math.isnan(s.ms_median)


def test_histogram_rows_equals_a_per_norm_reference():
    """Histograms, sums and maxima of mixed widths and kinds, with rows that have no share (zero or
    nan gradient) or no statistic at all (nan, inf or zero var, padding) and a norm without rows,
    against a naive loop."""
    from lnmonitor.core.meter.taps import CallRecord

    g = torch.Generator().manual_seed(5)
    recs = [CallRecord(1, 50, 16, 1e-5, 2), CallRecord(0, 40, 8, 1e-5, 1), CallRecord(1, 30, 16, 1e-5, 2)]
    data = torch.rand(5, 120, generator=g) * torch.exp(torch.randn(5, 120, generator=g) * 4)
    data[2] -= 0.5
    data[3, ::7] = 0.0
    data[3, 1::9] = math.nan
    data[0, 2::11], data[0, 3::13], data[1, 4::17] = math.nan, 0.0, math.inf
    data[:, -5:] = math.nan
    layout = H.Layout(3)
    flat = R.histogram_rows(StepRows(data, recs, [], {}), layout, "cpu").numpy()
    hist = flat[: layout.hist_size].reshape(3, layout.per_norm)
    sums = flat[layout.hist_size : layout.sum_end].reshape(3, H.N_SUMS)
    maxes = flat[layout.sum_end : layout.max_end].reshape(H.N_MAX, 3)
    norm = np.repeat([r.norm for r in recs], [r.rows for r in recs])
    d = np.repeat([r.width for r in recs], [r.rows for r in recs]).astype(np.float32)
    layer = np.repeat([r.dead_dim == 2 for r in recs], [r.rows for r in recs]).astype(np.float32)
    var, ms, sw, ww, wx2v = data.numpy()  # float32 arithmetic, as on the device
    with np.errstate(all="ignore"):
        stat = (var > 0) & (var < np.inf) & (ms < np.inf)
        share2 = (layer * sw * sw + wx2v) / (d * ww)
        ok = stat & (ww > 0) & (ww < np.inf) & (share2 < np.inf)
    share = np.sqrt(np.clip(np.where(ok, share2, 0), 0, 1))
    bins = (data[:2].numpy().view(np.int32) >> H.VALUE_SHIFT).astype(np.float64)
    for i in range(3):
        mine, sb, vb = norm == i, layout.share_bins, layout.value_bins
        assert sums[i, 0] == mine.sum() and sums[i, 1:4].tolist() == [0, 0, 0]
        assert sums[i, 4] == (mine & stat & (ww == 0)).sum()  # rows without gradient, finite input
        share_bin = np.minimum((share[mine & ok] * sb).astype(int), sb - 1)
        assert np.array_equal(hist[i, :sb], np.bincount(share_bin, minlength=sb))
        for k, (lo, hi) in enumerate(((sb, sb + vb), (sb + vb, sb + 2 * vb))):
            assert np.array_equal(hist[i, lo:hi], np.bincount(bins[k][mine & stat].astype(int), minlength=vb))
            assert maxes[1 + 2 * k, i] == np.max(bins[k][mine & stat], initial=-np.inf)
            assert maxes[2 + 2 * k, i] == np.max(-bins[k][mine & stat], initial=-np.inf)
        assert maxes[0, i] == np.max(share[mine & ok], initial=-np.inf)


def test_rows_without_a_target_are_the_final_norms_rows_without_gradient():
    """count_targets: a norm's rows without a target are its final norm's rows without gradient,
    times its rows per final-norm row; every row of a frozen norm; nan where none lines up."""
    def stats(rows, no_grad, pads=0):
        return R.RowStats(rows=rows, share_rows=rows - no_grad - pads, share_median=0.5, share_p90=0.5,
                          var_median=1.0, ms_median=1.0, share_max=0.5, layout=H.Layout(4), pad_rows=pads,
                          no_grad_rows=no_grad)

    # a block norm, a QK-norm's per-head rows (4 heads), the final norm, a frozen norm; 2 padding rows
    found = R.count_targets([stats(34, 9, 2), stats(128, 30), stats(34, 6, 2), stats(32, 32)],
                            [2, 2, 2, None], frozen={3})
    assert [s.without_target for s in found] == [6.0, 24.0, 6.0, 32.0]
    assert [s.vanished_grad_rows for s in found] == [3.0, 6.0, 0.0, 0.0]
    assert [s.zero_grad_rows for s in found] == [6, 24, 6, 32]
    # no final norm, or rows that are no whole multiple of its: not judged (nan), every row counted apart
    unjudged = R.count_targets([stats(30, 4), stats(32, 3)], [None, 1])
    assert all(math.isnan(s.vanished_grad_rows) for s in unjudged[:1]) and unjudged[0].zero_grad_rows == 4
    assert math.isnan(R.count_targets([stats(30, 4), stats(32, 3)], [1, 1])[0].without_target)


def test_read_gives_each_norms_medians_within_a_bin_of_its_rows():
    """read: each norm's var and ms medians within a bin (``VAR_RESOLUTION``) of its rows' own, the
    norms' values orders of magnitude apart, and its share median within ``SHARE_RESOLUTION``."""
    from lnmonitor.core.meter.taps import CallRecord

    g = torch.Generator().manual_seed(7)
    rows, d = 41, 16  # an odd count: each median is one row's value
    recs = [CallRecord(0, rows, d, 1e-5, 1), CallRecord(1, rows, d, 1e-5, 1)]
    scale = torch.tensor([1e-4, 1e3]).repeat_interleave(rows)
    var = torch.exp(torch.randn(2 * rows, generator=g) * 2) * scale
    ms = var * (1 + torch.rand(2 * rows, generator=g))
    share = 0.05 + 0.9 * torch.rand(2 * rows, generator=g)
    data = torch.stack([var, ms, torch.zeros(2 * rows), torch.ones(2 * rows), d * share**2])
    layout = H.Layout(2)
    flat = R.histogram_rows(StepRows(data, recs, [], {}), layout, "cpu")
    for i, stats in enumerate(R.read(flat[: layout.max_end], layout)):
        mine = slice(i * rows, (i + 1) * rows)
        assert stats.rows == stats.share_rows == rows
        assert stats.var_median == pytest.approx(var[mine].median().item(), rel=H.VAR_RESOLUTION)
        assert stats.ms_median == pytest.approx(ms[mine].median().item(), rel=H.VAR_RESOLUTION)
        assert stats.share_median == pytest.approx(share[mine].median().item(), abs=H.SHARE_RESOLUTION)
