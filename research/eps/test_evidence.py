"""The eps finding's figures (lnmonitor.core.findings.evidence) are the eps comparisons' records:
a rerun that moves one fails here."""

from __future__ import annotations

import json
import statistics

from lnmonitor.core.findings.evidence import EPS_COSTS, EPS_DELAYS, EPS_KNEE
from research.eps import RECORDS, RESULTS
from research.eps.delay import delays

# the eps comparisons EPS_COSTS reads: eps 0.1 against 1e-5 at GPT-2's init, paired seeds
EPS_COST_RECORDS = {
    "LayerNorm on the Python help text": RESULTS / "eps-compare-gpt2-init",
    "RMSNorm on the Python help text": RECORDS / "law-oos/rms-4x128",
    "LayerNorm on the standard library's source": RECORDS / "law-oos/python-source-4x128",
}

# the records EPS_DELAYS reads, each over its own schedule (docs/eps.md, "The cost as steps lost")
EPS_DELAY_RECORDS = {
    "LayerNorm on the Python help text": RESULTS / "eps-compare-gpt2-init",
    "LayerNorm on the Python help text, 1,000 steps": RECORDS / "delay-1000",
    "LayerNorm on the standard library's source": RECORDS / "law-oos/python-source-4x128",
    "LayerNorm on the standard library's source, 1,000 steps": RECORDS / "delay-source-1000",
}


def test_each_cost_is_the_mean_paired_difference_of_its_records():
    assert set(EPS_COST_RECORDS) == set(EPS_COSTS)
    for where, folder in EPS_COST_RECORDS.items():
        record = json.loads((folder / "results.json").read_text())
        recipe = record["runs"][0]["config"]["recipe"]
        assert recipe["init"] == "gpt2" and recipe["max_steps"] == 3000, where
        assert recipe["norm"] == ("rms" if where.startswith("RMSNorm") else "layer"), where
        assert ("source" in record["runs"][0]["data_name"]) == ("source" in where), where
        difference = record["differences"]["0.1"]
        assert difference["n"] >= 2 and round(difference["mean"], 4) == EPS_COSTS[where], where


def test_each_delay_is_the_steps_its_records_lost():
    assert set(EPS_DELAY_RECORDS) == set(EPS_DELAYS)
    for where, folder in EPS_DELAY_RECORDS.items():
        budget, median, low, high = EPS_DELAYS[where]
        steps = [d for d, _ in delays(folder, budgets=(budget - 1,))[budget - 1].values()]
        assert (round(statistics.median(steps)), round(min(steps)), round(max(steps))) == (median, low, high)


def test_the_knee_is_the_laws_at_step_0_its_best_predictor():
    law = json.loads((RECORDS / "law" / "law.json").read_text())
    assert law["best"] == "init" and round(law["fits"]["init"]["knee"], 1) == EPS_KNEE
