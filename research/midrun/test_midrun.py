"""The mid-run table's event and lead computations on synthetic series with known answers, and
one very short run producing a record with the expected keys.

    python -m pytest research/midrun/test_midrun.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from research.midrun import runs, table

P = 200


def flat_then(rise_at: int, height: float, n: int = 300, base: float = 2.0) -> list[float]:
    """A loss that falls slowly to ``base``, then steps up by ``height`` at ``rise_at``."""
    return [base + 1.0 / (1 + t) + (height if t >= rise_at else 0.0) for t in range(n)]


def test_visible_event_is_the_first_10_step_mean_above_running_min_plus_03():
    loss = flat_then(250, 1.0)
    # s_t - min = (k+1)/10 * 1.0 minus the slow fall; crosses 0.3 on the 3rd or 4th step of the rise
    assert table.visible_event(loss, P) in (252, 253)
    assert table.visible_event(flat_then(250, 0.2), P) is None  # 0.2 nats never is 0.3
    assert table.visible_event(flat_then(10_000, 1.0), P) is None
    nonfinite = flat_then(10_000, 0.0)
    nonfinite[260] = math.inf
    assert table.visible_event(nonfinite, P) == 260
    # a rise before P is not an event at or after P unless it persists above the running minimum
    early = flat_then(100, 1.0)
    assert table.visible_event(early, P) == P


def test_event_of_a_fine_tune_ignores_the_steps_before_its_start():
    loss = [2.0] * P + [5.0 - 0.01 * t for t in range(100)]  # the surgery's jump, then recovery
    assert table.visible_event(loss, P) == P + 1  # judged from step 0: the jump (+0.3 at P, +0.6 at P+1)
    assert table.visible_event(loss, P, start=P) is None  # judged from the fine-tune's start


def test_min_rule_and_the_peers_fire_at_or_after_p():
    loss = flat_then(250, 3.0)
    assert table.min_rule(loss, P) == 250
    gnorm = [1.0 + 0.01 * math.sin(t) for t in range(len(loss))]
    alarms = table.loss_alarms(loss, gnorm, P)
    assert alarms["minx1.5"] == 250
    assert alarms["olmo"] == 250  # 6 sigma of a flat window: the step itself
    assert alarms["kill_spike"] == 254  # llm-foundry: more than 4 outliers in a row
    # a detector firing before P is restarted after its firing
    seq = [0.0] * 10 + [9.0] + [0.0] * 20 + [9.0] + [0.0] * 5
    first_spike = lambda xs: next((i for i, v in enumerate(xs) if v > 1), None)  # noqa: E731
    assert table.from_p(first_spike, [seq], 20, 0, 15) == 31
    assert table.from_p(first_spike, [seq], 32, 0, 15) is None


def test_first_above_and_leads():
    values = [0.0] * 10 + [1.0, 5.0, 9.0]
    assert table.first_above(values, 4.0, 5) == 11
    assert table.first_above(values, 4.0, 12) == 12
    assert table.first_above([math.nan] * 5, 0.0, 0) is None
    # a run whose signal fires 3 steps before its event and 5 steps before its best loss rule
    signals = {k: [math.nan] * 300 for k in table.SIGNALS}
    signals["growth_start"] = [1.0] * 247 + [50.0] * 53
    run = {"kind": "lr10", "event": 250, "best_loss": 252, "P": P, "signals": signals,
           "loss_alarms": {"minx1.5": 252, "olmo": None, "kill_spike": 260}}
    thresholds = dict.fromkeys(table.SIGNALS, 10.0)
    c = table.cell_stats([run], "growth_start", thresholds)
    assert (c["hits"], c["events"], c["lead"], c["over"], c["over_pos"]) == (1, 1, 3, 5, 1)
    assert table.alarms(run, thresholds)["stream_growth 35x (shipped)"] == 247
    c = table.cell_stats([run], "minx1.5", thresholds)
    assert (c["hits"], c["lead"], c["over"]) == (1, -2, 0)
    late = dict(run, event=200)  # alarm 47 steps after the event: no hit
    assert table.cell_stats([late], "growth_start", thresholds)["hits"] == 0


def test_thresholds_are_fitted_on_the_fit_parts_quiet_controls_only():
    def run(kind, seed, peak, event=None):
        sig = {k: [0.0] * 300 for k in table.SIGNALS}
        sig["share_jump"][P + 5] = peak
        sig["share_jump"][P - 5] = 1e9  # before P: not counted
        return {"kind": kind, "seed": seed, "event": event, "P": P, "signals": sig}
    runs_ = [run("healthy", 0, 2.0), run("tall_sane", 0, 3.0), run("healthy", 1, 100.0),
             run("lr10", 0, 50.0, event=260), run("tall_sane", 0, 70.0, event=210)]
    assert table.fit_thresholds(runs_)["share_jump"] == pytest.approx(3.6)


def test_a_short_run_writes_a_record_with_the_expected_keys(tmp_path):
    torch.set_num_threads(1)
    written = runs.run_config("tiny-d4", 0, kinds=("healthy", "lr10"), steps=(12, 18), out=tmp_path)
    assert [p.parent.name for p in written] == ["healthy", "lr10"]
    rec = json.loads((tmp_path / "tiny-d4" / "lr10" / "seed=0.json").read_text())
    assert rec["P"] == 12 and rec["T"] == 18 and rec["kind"] == "lr10" and rec["fit_start"] == 0
    s = rec["series"]
    assert set(s) == {"loss", "gnorm", "lr", "gain_upd", "growth", "rms", "inv_sigma_final", "eps_var_final",
                      "share_final", "share_jump", "invsigma_jump"}
    assert all(len(v) == 18 for v in s.values())
    assert len(s["rms"][0]) == len(rec["rungs"]) == 2 * 4 + 1 and rec["final"] == rec["rungs"][-1]
    assert s["lr"][15] == pytest.approx(10 * s["lr"][11] * 16 / 12, rel=1e-3)  # x10 during warm-up
    healthy = json.loads((tmp_path / "tiny-d4" / "healthy" / "seed=0.json").read_text())["series"]
    assert healthy["loss"][:12] == s["loss"][:12]  # the shared prefix
    assert runs.run_config("tiny-d4", 0, kinds=("healthy",), steps=(12, 18), out=tmp_path) == []  # skipped
    judged = table.judge(rec)
    assert set(judged["loss_alarms"]) == set(table.LOSS_RULES)
    assert all(len(v) == 18 for v in judged["signals"].values())
