"""The library's figures for ``loss_blowup`` are these records' (lnmonitor.core.findings.evidence.TESTBED
and lnmonitor.core.findings.loss_rule's ranges): a rerun of the testbed that moves them fails here."""

from __future__ import annotations

import math

import pytest

from lnmonitor.core.findings.evidence import TESTBED
from lnmonitor.core.findings.loss_rule import FELL_IN_OPTIMIZER_BLOWUPS, ROSE_IN_DATA_BURSTS
from research.midrun import table as T

FIGURES = TESTBED["loss_blowup"]


@pytest.fixture(scope="module")
def judged():
    runs = T.load()
    T.mark_damage(runs)
    return runs, T.fit_thresholds(runs)


def test_the_loss_rules_held_out_figures_are_the_records(judged):
    runs, thresholds = judged
    held = [r for r in runs if r["seed"] not in T.FIT_SEEDS]
    cell = T.cell_stats(held, "minx1.5", thresholds)
    assert (cell["events"], cell["hits"]) == (FIGURES["events"], FIGURES["hits"])
    assert T.false_alarms(held, "minx1.5", thresholds) == (FIGURES["false"], FIGURES["healthy"])
    assert T.harmless_alarms(held, "minx1.5", thresholds) == (0, FIGURES["harmless"])


def test_the_final_norms_one_over_sigma_fell_in_every_optimizer_blow_up_and_in_no_data_burst(judged):
    runs, _ = judged
    ratios: dict[str, list[float]] = {"optimizer": [], "data": []}
    for r in runs:
        found = T.diagnosis(r)
        if found is not None and math.isfinite(found[2]):
            ratios["data" if r["kind"].startswith("burst") else "optimizer"].append(found[2])
    optimizer = (round(min(ratios["optimizer"]), 2), round(max(ratios["optimizer"]), 2))
    assert optimizer == FELL_IN_OPTIMIZER_BLOWUPS
    assert (round(min(ratios["data"]), 2), round(max(ratios["data"]), 2)) == ROSE_IN_DATA_BURSTS
    assert max(ratios["optimizer"]) < min(ratios["data"])


def test_the_loss_rule_on_runs_that_went_wrong_from_their_first_step():
    from research.stability import heldout as stability_heldout
    from research.stability import heldout_table

    confirmed = heldout_table.judge_heldout(stability_heldout.load(stability_heldout.CONFIRM_OUT,
                                                                   stability_heldout.CONFIRM_RUNS))
    scratch = heldout_table.figures([r for r in confirmed if not r.fine_tune], "running minimum x1.5",
                                    amended=True)
    assert (scratch["bad"], scratch["hits"]) == (FIGURES["from_start"], FIGURES["from_start_hits"])
    assert (scratch["clean"], scratch["false"]) == (FIGURES["from_start_clean"], FIGURES["from_start_false"])
