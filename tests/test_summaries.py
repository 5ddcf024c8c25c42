"""lnmonitor.core.summaries: fixed-bin quantiles within one bin, merging like one batch, empty summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (
    Net,
    run_tap,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from lnmonitor.core import summaries as S
from lnmonitor.core.taps import StepRows


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=300),
    st.sampled_from([0.1, 0.5, 0.9]),
)
def test_hist_quantile_within_one_bin(values, q):
    layout = S.Layout(1)
    v = np.asarray(values)
    counts = np.bincount(np.minimum((v * layout.share_bins).astype(int), layout.share_bins - 1),
                         minlength=layout.share_bins)
    est = S.hist_quantile(counts, layout.share_edges(), q, v.min(), v.max())
    assert abs(est - np.quantile(v, q)) <= S.SHARE_RESOLUTION + 1e-12


@pytest.mark.parametrize("centre", [1e-30, 9.8e-13, 1.0, 1e12, 1e30])
def test_value_quantiles_resolve_the_whole_float32_range(centre):
    """var and ms bins are the top 15 bits of the float32 value: every quantile within 2^-7
    of its value from 1e-30 to 1e30 (no clamp: a row of var 9.8e-13 reads 9.8e-13)."""
    rng = np.random.default_rng(0)
    v = (centre * np.exp(rng.normal(0, 2, 3001))).astype(np.float32)
    layout = S.Layout(1)
    counts = np.bincount(v.view(np.int32) >> S.VALUE_SHIFT, minlength=layout.value_bins)
    for q in (0.1, 0.5, 0.9):
        est = S.hist_quantile(counts, layout.value_edges(), q, float(v.min()), float(v.max()))
        assert abs(est / np.quantile(v.astype(np.float64), q) - 1) <= S.VAR_RESOLUTION


def test_value_edges_are_the_float32_bit_patterns():
    """Bins of width at most 2^-7 of their value over every normal float32 (1.2e-38 up); the
    bins of inf and nan read as inf."""
    edges = S.Layout(1).value_edges()
    finite = edges[np.isfinite(edges)]
    assert edges[0] == 0.0 and np.isinf(edges[-1]) and np.all(np.diff(finite) > 0)
    normal = np.flatnonzero(finite >= np.finfo(np.float32).tiny)
    lower, upper = finite[normal[:-1]], finite[normal[1:]]
    assert np.max((upper - lower) / lower) <= S.VAR_RESOLUTION * (1 + 1e-12)


def test_summaries_merge_like_one_batch():
    torch.manual_seed(1)
    model = Net(24, "layer")
    x = torch.randn(40, 6)
    layout = S.Layout(2)
    _, whole, _ = run_tap(model, x)
    model.zero_grad()
    # the two halves, each with its own loss (the share is per row and scale-free)
    _, a, _ = run_tap(model, x[:17])
    _, b, _ = run_tap(model, x[17:])
    one = S.merge(S.summarise(whole, layout, "cpu"), layout)
    two = S.merge(
        torch.stack([S.summarise(a, layout, "cpu"), S.summarise(b, layout, "cpu")]), layout
    )
    r1, r2 = S.read(one, layout), S.read(two, layout)
    for s1, s2 in zip(r1, r2, strict=True):
        assert s1.rows == s2.rows == 40
        assert abs(s1.share_max - s2.share_max) < 1e-6
        assert abs(s1.share_quantile(0.5) - s2.share_quantile(0.5)) <= 2 * S.SHARE_RESOLUTION
        assert abs(s1.var_median / s2.var_median - 1) <= 2 * S.VAR_RESOLUTION
        assert abs(s1.ms_median / s2.ms_median - 1) <= 2 * S.VAR_RESOLUTION
        assert s1.var_min == s2.var_min and s1.var_max == s2.var_max


def test_empty_summary_reads_as_nan():
    layout = S.Layout(3)
    out = S.summarise(StepRows(None, [], [], {}), layout, "cpu")
    s = S.read(S.merge(out, layout), layout)[1]
    assert s.rows == 0 and math.isnan(s.share_quantile(0.5))
    assert math.isnan(s.var_median) and math.isnan(s.ms_median)


def test_vectorised_quantiles_equal_the_reference():
    rng = np.random.default_rng(3)
    layout = S.Layout(1)
    share = rng.beta(1, 30, size=(4, 700)) ** 0.5
    counts = np.stack([np.bincount(np.minimum((r * 4096).astype(int), 4095), minlength=4096)
                       for r in share])
    counts[2] = 0  # an empty row reads as nan
    lo, hi = np.zeros(4), share.max(1)
    got = S.hist_quantiles(counts.astype(np.float32), layout.share_edges(), (0.5, 0.9, 0.01), lo, hi)
    for i in range(4):
        for j, q in enumerate((0.5, 0.9, 0.01)):
            ref = S.hist_quantile(counts[i], layout.share_edges(), q, lo[i], hi[i])
            if i == 2:
                assert math.isnan(got[i, j]) and math.isnan(ref)
            else:
                assert got[i, j] == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_summarise_equals_a_per_norm_reference():
    """Histograms, sums and maxima of mixed widths and kinds, with rows that have no share (zero or
    nan gradient) or no statistic at all (nan, inf or zero var, padding) and a norm without rows,
    against a naive loop."""
    from lnmonitor.core.taps import CallRecord

    g = torch.Generator().manual_seed(5)
    recs = [CallRecord(1, 50, 16, 1e-5, 2), CallRecord(0, 40, 8, 1e-5, 1), CallRecord(1, 30, 16, 1e-5, 2)]
    data = torch.rand(5, 120, generator=g) * torch.exp(torch.randn(5, 120, generator=g) * 4)
    data[2] -= 0.5
    data[3, ::7] = 0.0
    data[3, 1::9] = math.nan
    data[0, 2::11], data[0, 3::13], data[1, 4::17] = math.nan, 0.0, math.inf
    data[:, -5:] = math.nan
    layout = S.Layout(3)
    flat = S.summarise(StepRows(data, recs, [], {}), layout, "cpu").numpy()
    hist = flat[: layout.hist_size].reshape(3, layout.per_norm)
    sums = flat[layout.hist_size : layout.sum_end].reshape(3, S.N_SUMS)
    maxes = flat[layout.sum_end : layout.max_end].reshape(S.N_MAX, 3)
    norm = np.repeat([r.norm for r in recs], [r.rows for r in recs])
    d = np.repeat([r.width for r in recs], [r.rows for r in recs]).astype(np.float32)
    layer = np.repeat([r.dead_dim == 2 for r in recs], [r.rows for r in recs]).astype(np.float32)
    var, ms, sw, ww, wx2v = data.numpy()  # float32 arithmetic, as on the device
    with np.errstate(all="ignore"):
        stat = (var > 0) & (var < np.inf) & (ms < np.inf)
        share2 = (layer * sw * sw + wx2v) / (d * ww)
        ok = stat & (ww > 0) & (ww < np.inf) & (share2 < np.inf)
    share = np.sqrt(np.clip(np.where(ok, share2, 0), 0, 1))
    bins = (data[:2].numpy().view(np.int32) >> S.VALUE_SHIFT).astype(np.float64)
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
