"""research.stability.table on synthetic runs (no training): what a signal did over
the runs (hits, lead times, late flags, false alarms), the run each run's damage is judged
against, and the per-run table."""

from __future__ import annotations

from research.stability import events as ev
from research.stability.table import RunEvents, analyse, markdown, signal_figures


def events(name: str, fire: int | None, divergence=None, spike=None, damage=None) -> RunEvents:
    return RunEvents(name, 0, 2.0, divergence, spike, damage, {"growth": fire})


def test_a_signal_leads_the_runs_it_flags_at_or_before_their_earliest_event():
    runs = [
        events("a", 40, divergence=100),  # 60 steps ahead
        events("b", 30, spike=50, damage=30),  # at the earliest event (30): in time, lead 0
        events("c", 210, divergence=200),  # 10 steps late
        events("d", None, damage=80),  # missed
        events("e", 20, divergence=120),  # 100 steps ahead
        events("f", 5),  # clean, flagged: a false alarm
        events("g", None),  # clean, quiet
    ]
    assert signal_figures(runs, "growth") == {
        "bad": 5, "clean": 2, "hits": 3, "lead": 60, "lead_min": 0, "lead_max": 100,
        "late": 1, "late_max": 10, "false": 1,
    }


def record(config: str, final: float, loss: list[float], measured: list[dict]) -> dict:
    return {"config": config, "seed": 0, "group": "lr", "recipe": {}, "final_val_loss": final, "loss": loss,
            "grad_norm": [1.0] * len(loss), "measured": measured, "steps": len(loss), "cpu_seconds": 1.0}


def test_damage_is_judged_against_the_groups_best_run_and_the_table_shows_each_runs_steps():
    good = [3.0] * 100 + [1.9] * 200
    hurt = [3.0] * 60 + [4.0] + [3.0] * 89 + [2.5] * 150  # a spike at step 60, then damage
    records = [
        record("good", 1.9, good, []),
        record("hurt", 2.5, hurt, [{"step": 0, "growth": 10.0}, {"step": 10, "growth": 25.0},
                                   {"step": 20, "growth": 26.0}]),
        record("flat", 3.0, [3.0] * 300, []),  # the worst: against it, "hurt" would be no damage
    ]
    runs = {r.name: r for r in analyse(records)}
    onset = ev.damage_onset(hurt, good, final=2.5, best_final=1.9)
    assert onset is not None and runs["hurt"].damage == onset and runs["good"].damage is None
    assert runs["hurt"].spike == 60 == runs["hurt"].event < onset and runs["hurt"].divergence is None
    # growth crosses 20 at step 10; its rate there is log10(25/10)/10 = 0.040 per step (> 0.02), at
    # step 20 log10(26/25)/10 = 0.0017
    assert runs["hurt"].fires["growth"] == 10 and runs["hurt"].fires["growth_rate"] == 10
    row = next(ln for ln in markdown(records).splitlines() if ln.startswith("| hurt |"))
    assert row.startswith(f"| hurt | 0 | 2.5000 | - | 60 | {onset} | 60 | 10 | 10 | - |"), row
