"""The step vector's histograms (lnmonitor.core.meter.row_stats): quantiles within one bin over the
whole float32 range, many histograms read at once as each alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lnmonitor.core.meter import row_stats as H


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=300),
    st.sampled_from([0.1, 0.5, 0.9]),
)
def test_hist_quantile_within_one_bin(values, q):
    layout = H.Layout(1)
    v = np.asarray(values)
    counts = np.bincount(np.minimum((v * layout.share_bins).astype(int), layout.share_bins - 1),
                         minlength=layout.share_bins)
    est = H.hist_quantiles(counts[None], layout.share_edges(), (q,), [v.min()], [v.max()])[0, 0]
    assert abs(est - np.quantile(v, q)) <= H.SHARE_RESOLUTION + 1e-12


@pytest.mark.parametrize("centre", [1e-30, 9.8e-13, 1.0, 1e12, 1e30])
def test_value_quantiles_resolve_the_whole_float32_range(centre):
    """var and ms bins are the top 15 bits of the float32 value: every quantile within 2^-7
    of its value from 1e-30 to 1e30 (no clamp: a row of var 9.8e-13 reads 9.8e-13)."""
    rng = np.random.default_rng(0)
    v = (centre * np.exp(rng.normal(0, 2, 3001))).astype(np.float32)
    layout = H.Layout(1)
    counts = np.bincount(v.view(np.int32) >> H.VALUE_SHIFT, minlength=layout.value_bins)
    for q in (0.1, 0.5, 0.9):
        est = H.hist_quantiles(counts[None], layout.value_edges(), (q,), [v.min()], [v.max()])[0, 0]
        assert abs(est / np.quantile(v.astype(np.float64), q) - 1) <= H.VAR_RESOLUTION


def test_value_edges_are_the_float32_bit_patterns():
    """Bins of width at most 2^-7 of their value over every normal float32 (1.2e-38 up); the
    bins of inf and nan read as inf."""
    edges = H.Layout(1).value_edges()
    finite = edges[np.isfinite(edges)]
    assert edges[0] == 0.0 and np.isinf(edges[-1]) and np.all(np.diff(finite) > 0)
    normal = np.flatnonzero(finite >= np.finfo(np.float32).tiny)
    lower, upper = finite[normal[:-1]], finite[normal[1:]]
    assert np.max((upper - lower) / lower) <= H.VAR_RESOLUTION * (1 + 1e-12)


def test_quantiles_of_many_histograms_at_once_are_each_within_one_bin():
    rng = np.random.default_rng(3)
    layout = H.Layout(1)
    share = rng.beta(1, 30, size=(4, 700)) ** 0.5
    counts = np.stack([np.bincount(np.minimum((r * 4096).astype(int), 4095), minlength=4096)
                       for r in share])
    counts[2] = 0  # an empty row reads as nan
    lo, hi = np.zeros(4), share.max(1)
    got = H.hist_quantiles(counts.astype(np.float32), layout.share_edges(), (0.5, 0.9, 0.01), lo, hi)
    for i in range(4):
        for j, q in enumerate((0.5, 0.9, 0.01)):
            if i == 2:
                assert math.isnan(got[i, j])
            else:
                assert abs(got[i, j] - np.quantile(share[i], q)) <= H.SHARE_RESOLUTION + 1e-12


def test_histograms_of_different_spans_read_together_read_as_apart():
    """stack_histograms pads the narrower spans with empty bins: every quantile is the same to
    the bit as read from each span on its own (an empty row too, and an infinite last edge)."""
    rng = np.random.default_rng(5)
    edges = H.Layout(1).value_edges()
    wide = rng.integers(0, 9, size=(3, 40)).astype(np.float32)
    narrow = rng.integers(0, 9, size=(3, 7)).astype(np.float32)
    narrow[1] = 0
    wide_edges, narrow_edges = edges[16200:16241], edges[-8:]  # the last span ends at inf
    lo, hi = np.zeros(6), np.full(6, np.inf)
    with np.errstate(invalid="ignore"):
        together = H.hist_quantiles(*H.stack_histograms([(wide, wide_edges), (narrow, narrow_edges)]),
                                    (0.5, 0.9), lo, hi)
        apart = np.concatenate((H.hist_quantiles(wide, wide_edges, (0.5, 0.9), lo[:3], hi[:3]),
                                H.hist_quantiles(narrow, narrow_edges, (0.5, 0.9), lo[3:], hi[3:])))
    np.testing.assert_array_equal(together, apart)
    assert np.isnan(together[4]).all() and np.isfinite(together[:3]).all()
