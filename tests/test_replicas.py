"""Rows that several processes hold alike are told apart by their fingerprints (tensor
parallelism's replicated activations count once in the merge: tests/test_processes.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import whole_and_parts

from lnmonitor.core.meter.row_stats import fingerprints, replicated


def test_a_process_drops_the_norms_an_earlier_process_holds_alike():
    whole, a, b = whole_and_parts()
    prints = torch.stack([fingerprints(r.data, [c.rows for c in r.records], [c.norm for c in r.records], 2)
                          for r in (a, a, b, whole)])
    prints[3, 1] = 0.0  # no fingerprint (one process, or a norm without rows): never a replica
    prints = torch.cat((prints, prints[3:]))
    assert [replicated(prints, rank).tolist() for rank in range(5)] == [
        [False, False], [True, True], [False, False], [False, False], [True, False]]


def test_fingerprints_tell_rows_apart_and_ignore_the_order_of_calls_of_other_norms():
    whole, a, b = whole_and_parts()
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
