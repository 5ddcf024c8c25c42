"""research.stability.events: the testbed's events, exactly as docs/findings.md defines them, and
the peers' loss rules, against hand-built series."""

from __future__ import annotations

import math

from research.stability import events as ev


def test_divergence_is_20_steps_above_twice_the_running_minimum_or_a_non_finite_loss():
    loss = [4.0, 3.0, 2.0] + [4.1] * 19 + [1.0]
    assert ev.divergence(loss) is None  # 19 steps above 2x the minimum: not yet
    assert ev.divergence([4.0, 3.0, 2.0] + [4.1] * 20) == 3
    assert ev.divergence([4.0, 3.0, 2.0] + [4.0] * 30) is None  # 2x exactly is not above
    assert ev.divergence([4.0, 3.0, math.nan]) == 2
    assert ev.divergence([4.0, math.inf]) == 1


def test_a_spike_is_a_loss_above_1_25x_the_median_of_the_20_before():
    flat = [2.0] * 30
    assert ev.spike(flat) is None
    assert ev.spike(flat[:25] + [2.51] + flat[:4]) == 25
    assert ev.spike(flat[:25] + [2.5] + flat[:4]) is None
    assert ev.spike([2.0] * 10 + [9.0]) is None  # fewer than 20 steps before it


def test_damage_is_a_final_loss_beyond_the_margin_with_its_onset_on_the_smoothed_training_loss():
    best = [3.0] * 100 + [1.9] * 200
    mine = [3.0] * 150 + [2.5] * 150
    onset = ev.damage_onset(mine, best, final=2.5, best_final=1.9)
    assert onset == 104
    # the onset: the first step from which the 50-step means stay more than 0.10 apart
    gap = [sum(mine[max(0, i - 49):i + 1]) / min(i + 1, 50) - sum(best[max(0, i - 49):i + 1]) / min(i + 1, 50)
           for i in range(300)]
    assert onset == next(i for i in range(300) if all(g > 0.10 for g in gap[i:]))
    assert ev.damage_onset(mine, best, final=2.0, best_final=1.9) is None  # within the margin


# the peers' rules (llm-foundry KillLossSpike, OLMo-core StabilityMonitorCallback)


def test_kill_loss_spike_fires_on_the_fifth_outlier_after_a_full_window():
    loss = [1.0] * 100 + [3.0] * 10
    assert ev.kill_loss_spike(loss) == 104  # outliers at 100..104: the counter passes patience 4
    assert ev.kill_loss_spike([1.0] * 100 + [3.0] * 4 + [1.0] + [3.0] * 4) is None  # reset between
    # step 99 is not checked (the window holds 99 losses): the fifth checked outlier is step 104
    assert ev.kill_loss_spike([1.0] * 99 + [3.0] * 10) == 104
    assert ev.kill_loss_spike([1.0] * 50 + [math.nan] * 60) is None  # a nan is no outlier to it
    assert ev.kill_loss_spike([11.0] * 250) == 200  # persistently above loss_cap 10 after 2 windows


def test_olmo_stability_monitor_fires_above_mean_plus_6_population_sd_of_the_last_128():
    base = [1.0 + 0.1 * (i % 2) for i in range(128)]  # mean 1.05, population sd 0.05
    assert ev.olmo_stability_monitor(base + [1.05 + 6 * 0.05 + 1e-9]) == 128
    assert ev.olmo_stability_monitor(base + [1.05 + 6 * 0.05 - 1e-9]) is None
    assert ev.olmo_stability_monitor([1.0] * 200 + [100.0]) is None  # sd 0: never
    assert ev.olmo_stability_monitor(base[:127] + [9.0]) is None  # a window of 127 is not full
    grad = base + [9.0]
    assert ev.olmo_stability_monitor(base + [1.0], grad) == 128  # the gradient norm counts too
