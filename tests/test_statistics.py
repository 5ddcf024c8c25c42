"""lnmonitor.experiments.eps.statistics: the Student-t interval, the loss difference paired by seed,
and a verdict that claims no more than its interval."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from lnmonitor.experiments.eps import statistics


def test_interval_is_the_student_t_interval():
    values = [1.50, 1.54, 1.57, 1.49]
    got = statistics.interval(values)
    lo, hi = stats.t.interval(0.95, len(values) - 1, loc=sum(values) / 4, scale=stats.sem(values))
    assert got["n"] == 4 and math.isclose(got["lo"], lo) and math.isclose(got["hi"], hi)
    one = statistics.interval([1.5])
    assert one["mean"] == 1.5 and one["half_width"] is None and one["lo"] is None
    assert statistics.interval([])["mean"] is None
    assert statistics.interval([1.0, None, math.nan, 3.0])["n"] == 2


def _records(losses: dict) -> dict:
    return {(e, s): {"eps": e, "seed": s, "headline": {"val_loss": v}} for (e, s), v in losses.items()}


def test_the_difference_is_paired_by_seed():
    # seeds differ a lot, the eps effect is a constant +0.02 within each seed: pairing resolves it
    base = {0: 1.50, 1: 1.70, 2: 1.60}
    recs = _records({
        **{(1e-5, s): v for s, v in base.items()}, **{(0.1, s): v + 0.02 for s, v in base.items()}
    })
    diff = statistics.paired_difference(recs, 0.1, 1e-5)
    assert diff["n"] == 3 and math.isclose(diff["mean"], 0.02) and diff["half_width"] < 1e-9
    assert diff["verdict"].startswith("eps=0.1 is worse than eps=1e-05 by 0.0200 +/- 0.0000")


@pytest.mark.parametrize(
    "deltas, start",
    [
        ([0.05, 0.06, 0.04], "eps=0.1 is worse than eps=1e-05 by 0.0500 +/- "),
        ([-0.05, -0.06, -0.04], "eps=0.1 is better than eps=1e-05 by 0.0500 +/- "),
        ([0.05, -0.04, 0.01], "No difference resolved at this number of seeds"),
        ([0.05], "eps=0.1 minus eps=1e-05: +0.0500 nats/char from a single seed"),
    ],
)
def test_the_verdict_claims_no_more_than_the_interval(deltas, start):
    recs = _records({
        **{(1e-5, s): 1.5 for s in range(len(deltas))},
        **{(0.1, s): 1.5 + d for s, d in enumerate(deltas)},
    })
    diff = statistics.paired_difference(recs, 0.1, 1e-5)
    assert diff["verdict"].startswith(start), diff["verdict"]
    if diff["half_width"] is not None and "worse" in start:
        assert diff["lo"] > 0
    if "No difference" in start:
        assert diff["lo"] <= 0 <= diff["hi"] and "includes 0" in diff["verdict"]


def test_unpaired_seeds_are_left_out_of_the_difference():
    recs = _records({(1e-5, 0): 1.5, (1e-5, 1): 1.6, (0.1, 1): 1.7, (0.1, 2): 1.9})
    diff = statistics.paired_difference(recs, 0.1, 1e-5)
    assert diff["seeds"] == [1] and math.isclose(diff["mean"], 0.1)


def test_intervals_of_positive_quantities_are_computed_on_log_scale():
    values = [1e-6, 3e-6, 2e-5]
    linear, log = statistics.interval(values), statistics.interval(values, log=True)
    assert linear["lo"] < 0  # a t interval of a residual reaching below zero
    assert 0 < log["lo"] < log["mean"] < log["hi"]
    assert log["mean"] == pytest.approx(math.exp(np.mean(np.log(values))))
    assert statistics.interval([1e-6, -1.0, 0.0], log=True)["n"] == 1  # not positive: dropped
