"""Rows that several processes hold alike count once in the merge (tensor parallelism's
replicated activations), rows of their own add up (sequence parallelism, data parallelism)."""

from __future__ import annotations

import pytest
import torch
from conftest import Net, run_tap

from lnmonitor.core.maths import histograms as H
from lnmonitor.core.maths.replicas import fingerprints
from lnmonitor.core.meter import row_stats as R


def _halves():
    torch.manual_seed(1)
    model = Net(24, "layer")
    x = torch.randn(40, 6)
    _, whole, _ = run_tap(model, x)
    model.zero_grad()
    _, a, _ = run_tap(model, x[:17])
    _, b, _ = run_tap(model, x[17:])
    return whole, a, b


def test_a_replica_counts_once_and_rows_of_their_own_add_up():
    whole, a, b = _halves()
    layout = H.Layout(2)
    fa, fb = (R.histogram_rows(r, layout, "cpu", fingerprint=True) for r in (a, b))
    one = R.read(H.merge(R.histogram_rows(whole, layout, "cpu"), layout), layout)
    # four processes: two tensor-parallel pairs, each pair holding the same rows
    four = R.read(H.merge(torch.stack([fa, fa.clone(), fb, fb.clone()]), layout), layout)
    for s1, s4 in zip(one, four, strict=True):
        assert s4.rows == s1.rows == 40  # not 80
        assert abs(s4.share_max - s1.share_max) < 1e-6
        assert (s4.var_counts == s1.var_counts).all()
        assert abs(s4.share_quantile(0.5) - s1.share_quantile(0.5)) <= 2 * H.SHARE_RESOLUTION
    # a replica's merge is the one process's vector, to the bit (flat rows count no targets: nan)
    alone = H.merge(fa, layout)
    torch.testing.assert_close(H.merge(torch.stack([fa, fa.clone()]), layout), alone,
                               rtol=0, atol=0, equal_nan=True)


def test_without_fingerprints_every_process_counts():
    whole, a, _ = _halves()
    layout = H.Layout(2)
    fa = R.histogram_rows(a, layout, "cpu")  # one process, or no fingerprint asked for
    assert (fa[layout.max_end :] == 0).all()
    two = R.read(H.merge(torch.stack([fa, fa.clone()]), layout), layout)
    assert [s.rows for s in two] == [34, 34]


def test_fingerprints_tell_rows_apart_and_ignore_the_order_of_calls_of_other_norms():
    whole, a, b = _halves()
    recs = [r.norm for r in a.records]
    counts = [r.rows for r in a.records]
    fa = fingerprints(a.data, counts, recs, 2)
    fb = fingerprints(b.data, [r.rows for r in b.records], [r.norm for r in b.records], 2)
    assert (fa != fb).all() and (fa != 0).all()
    # the sum over each norm's rows in float64, exactly
    per_row = torch.nan_to_num(a.data.double(), nan=0.0, posinf=0.0, neginf=0.0).sum(0)
    split = torch.split(per_row, counts)
    for norm in range(2):
        ref = sum(float(part.sum()) for part, n in zip(split, recs, strict=True) if n == norm)
        assert float(fa[norm]) == pytest.approx(ref, rel=1e-12)
