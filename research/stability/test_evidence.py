"""The findings' figures (lnmonitor.core.findings.evidence) are the testbed's records: a rerun that
moves one fails here (loss_blowup's: research/midrun/test_figures.py)."""

from __future__ import annotations

from lnmonitor.core.findings.evidence import EPS_KNEE, TESTBED
from lnmonitor.core.findings.reader import KINDS
from research.stability import heldout as H
from research.stability import heldout_table as T
from research.stability.candidate_signals import CANDIDATES
from research.stability.table import PEERS, analyse, load_records, signal_figures


def test_the_messages_quote_the_testbeds_records_and_the_thresholds_are_the_tested_ones():
    """stream_growth: its threshold the pre-registered one, its figures the confirmation part's, which
    passed the rule to ship; eps_dominates: the fitted testbed's."""
    confirmed = T.judge_heldout(H.load(H.CONFIRM_OUT, H.CONFIRM_RUNS))
    assert len(confirmed) == len(H.CONFIRM_RUNS)
    stream = KINDS["stream_growth"]
    rule = f"growth_over_start > {stream.threshold:g}"
    assert rule in T.RULES and stream.signal == "growth_over_start"
    figures = T.figures(confirmed, rule, amended=True)
    assert TESTBED["stream_growth"] == figures
    assert T.ships(rule, figures)
    runs = analyse(load_records(T.FITTED))
    eps = KINDS["eps_dominates"]
    assert CANDIDATES[eps.signal] == (eps.direction, eps.threshold) and eps.threshold == EPS_KNEE
    peers = max(signal_figures(runs, p)["hits"] for p in PEERS)
    assert TESTBED["eps_dominates"] == {**signal_figures(runs, eps.signal), "peer_hits": peers}


def test_the_default_recipe_raises_no_finding_in_the_testbed():
    """Evidence from the testbed's runs of the default recipe (lr 3e-3, one-cycle warm-up) at
    reduced steps and batch (300 steps, batch 16): no kind fires in any seed at its threshold."""
    records = load_records(T.FITTED)
    runs = [r for r in analyse(records) if r.name == "lr3e-3"]
    assert runs and all(r.fires["first_eps_over_var"] is None for r in runs)
    judged = [r for r in T.judge_fitted(records) if r.name == "lr3e-3"]
    assert judged and all(r.fires["growth_over_start > 35"] is None for r in judged)
