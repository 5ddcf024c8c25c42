"""The held-out part of the findings' testbed: its events and rules on hand-built series (exact),
its tables regenerated from the committed records, and one run end to end."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

import lnmonitor
from research.stability import heldout as H
from research.stability import heldout_table as T

ROOT = Path(__file__).resolve().parents[2]


def test_the_visible_event_is_the_ten_step_mean_above_the_references_or_a_non_finite_loss():
    reference = [3.0] * 30
    assert T.visible_event([3.0] * 30, reference) is None
    # 0.31 above from step 12 on: the first window wholly above is step 21's (step 20's mean 3.279)
    worse = [3.0] * 12 + [3.31] * 18
    assert T.visible_event(worse, reference) == 21
    # a loss far above from step 2 shows in the first window (step 9)
    assert T.visible_event([3.0, 3.0] + [9.0] * 28, reference) == 9
    assert T.visible_event([3.0, math.nan] + [3.0] * 28, reference) == 1
    assert T.damaged([3.0] * 10 + [3.2] * 20, reference) and not T.damaged([3.05] * 30, reference)
    assert T.damaged([3.0] * 29 + [math.inf], reference)


def test_the_growth_rules_and_the_running_minimum_fire_where_they_should():
    points = [(0, 2.0), (1, 2.5), (2, 3.0), (3, 80.0), (4, 90.0)]
    fires = T.growth_fires(points)
    assert fires == {"growth_jump > 25": 3, "growth_over_start > 35": 3, "growth > 20": 3}
    slow = [(s, 2.0 * 1.3 ** s) for s in range(20)]  # x1.3 a step: x13.8 in 10 steps, 2.0 -> 288
    fires = T.growth_fires(slow)
    assert fires["growth_jump > 25"] is None
    assert fires["growth > 20"] == 9 and fires["growth_over_start > 35"] == 14  # 1.3**14 = 39.4
    assert T.running_minimum([3.0] * 10 + [2.0, 3.1]) == 11 and T.running_minimum([3.0] * 12) is None
    assert T.running_minimum([3.0] * 11 + [math.nan]) == 11


def test_the_rule_to_ship():
    held = dict(bad=9, hits=6, clean=20, false=2, false_fine_tunes=0, blowups=3, blowup_hits=2)
    assert T.ships("growth > 20", held) and T.ships("growth_jump > 25", held)
    assert not T.ships("growth > 20", {**held, "hits": 5})
    assert not T.ships("growth > 20", {**held, "false": 3})
    assert not T.ships("growth > 20", {**held, "false_fine_tunes": 1})
    assert not T.ships("growth_jump > 25", {**held, "blowup_hits": 1})
    assert not T.ships("growth > 20", {})


def test_the_docs_tables_are_the_records():
    doc = (ROOT / "docs" / "findings.md").read_text()
    inside = doc.split(T.MARKERS[0], 1)[1].split(T.MARKERS[1], 1)[0]
    records = H.load(H.DEFAULT_OUT)
    assert len(records) == len(H.RUNS)  # every run of the part, none missing
    from research.stability.table import load_records

    table = T.markdown(T.judge_fitted(load_records(T.FITTED)), T.judge_heldout(records))
    assert inside == "\n" + table


def test_one_held_out_run_records_every_step(monkeypatch):
    monkeypatch.setattr(H, "STEPS", 12)
    monkeypatch.setattr(H, "TRAIN_CHARS", 20_000)
    record = H.run(H.HeldOutRun("torch-nn", 1e-3, 0, 0))
    assert len(record["loss"]) == len(record["growth"]) == len(record["grad_norm"]) == 12
    assert [m["step"] for m in record["measured"]] == [0, 10]
    assert all(g is not None and g > 1 for g in record["growth"])  # the watch, every step
    assert record["growth"][0] == pytest.approx(record["measured"][0]["growth"])
    assert record["measured"][0]["vanished_share"] == 0.0


@pytest.mark.parametrize("lr", [1e-3, 1e-1])
def test_a_model_built_outside_the_project_is_quiet_healthy_and_said_at_its_blow_up(lr):
    """The held-out part's torch.nn pre-LN transformer (a ladder ~40x at initialisation),
    trained for real on the standard library's source at the defaults but every_n_steps=10:
    lr 1e-3 trains well and raises nothing; lr 0.1 blows up within a few steps and is said at
    the step the every-step growth crosses, before the first measured step after 0."""
    from lnmonitor.integrations.loop import LoopMonitor

    torch.manual_seed(0)
    model = H.TorchPreLN()
    data = H.corpus("source")[:50_000]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    seen = []
    monitor = LoopMonitor(model, every_n_steps=10, images=False, summary=False, max_steps=30,
                          invariance_every_n_steps=None, on_finding=seen.append)
    feed = H.batches(data, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(30):
            x, y = next(feed)
            with monitor.step(step):
                torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    assert monitor.findings.start[1] > 20  # tall at its first measured step: information only
    said = [w for w in caught if w.category is lnmonitor.HealthWarning]
    if lr == 1e-3:
        assert not seen and not said
    else:
        assert [f.kind for f in seen] == ["stream_growth"] and len(said) == 1
        assert 0 < seen[0].step < 10 and seen[0].value > 35  # said between the measured steps 0 and 10
