"""What happened in a testbed run, and when: the events (docs/findings.md defines them before
any run was measured) and the two peers' loss-based detectors, on one run's loss series.

Events, each the first step it holds (None when it never does):

* **divergence**: a non-finite loss, or the loss above :data:`DIVERGE_FACTOR` x its running
  minimum (over the steps before) for :data:`DIVERGE_STEPS` steps in a row (the first of them);
* **spike**: from step :data:`SPIKE_WINDOW` on, a loss above :data:`SPIKE_FACTOR` x the median
  of the :data:`SPIKE_WINDOW` losses before it;
* **damage**: the run's final validation loss is worse than the best run of its group by more
  than :data:`DAMAGE_MARGIN` nats/char; its onset is the first step from which the run's
  training loss, averaged over :data:`DAMAGE_SMOOTH` steps, stays above the best run's (same
  seed, same batches) by more than the margin to the end.

Peers, on the same losses (faithful to their sources, cited in docs/findings.md):

* :func:`kill_loss_spike`: llm-foundry's ``KillLossSpike`` at its defaults (patience 4,
  outlier_multiplier 2, window_size 100, loss_cap 10);
* :func:`olmo_stability_monitor`: OLMo-core's ``StabilityMonitorCallback`` at its defaults
  (window_size 128, threshold_std 6, on the loss and the gradient norm).

Standard library only.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

__all__ = [
    "DAMAGE_MARGIN", "DAMAGE_SMOOTH", "DIVERGE_FACTOR", "DIVERGE_STEPS", "SPIKE_FACTOR", "SPIKE_WINDOW",
    "damage_onset", "divergence", "kill_loss_spike", "olmo_stability_monitor", "spike",
]

DIVERGE_FACTOR, DIVERGE_STEPS = 2.0, 20
SPIKE_FACTOR, SPIKE_WINDOW = 1.25, 20
DAMAGE_MARGIN, DAMAGE_SMOOTH = 0.10, 50


def divergence(loss: Sequence[float]) -> int | None:
    """The first step of divergence (see the module docstring), or None."""
    lowest, run = math.inf, 0
    for step, value in enumerate(loss):
        if not math.isfinite(value):
            return step
        run = run + 1 if value > DIVERGE_FACTOR * lowest else 0
        if run >= DIVERGE_STEPS:
            return step - run + 1
        lowest = min(lowest, value)
    return None


def spike(loss: Sequence[float]) -> int | None:
    """The first spike (see the module docstring), or None."""
    for step in range(SPIKE_WINDOW, len(loss)):
        if loss[step] > SPIKE_FACTOR * statistics.median(loss[step - SPIKE_WINDOW:step]):
            return step
    return None


def _smooth(loss: Sequence[float]) -> list[float]:
    out, window, total = [], deque(), 0.0
    for value in loss:
        window.append(value)
        total += value
        if len(window) > DAMAGE_SMOOTH:
            total -= window.popleft()
        out.append(total / len(window))
    return out


def damage_onset(loss: Sequence[float], best_loss: Sequence[float], final: float,
                 best_final: float) -> int | None:
    """The onset of damage against the group's best run (see the module docstring), or None
    when the final validation loss is within the margin of the best's."""
    if math.isfinite(final) and final <= best_final + DAMAGE_MARGIN:
        return None
    mine, best = _smooth(loss), _smooth(best_loss)
    onset = None
    for step in range(min(len(mine), len(best))):
        behind = not math.isfinite(mine[step]) or mine[step] > best[step] + DAMAGE_MARGIN
        onset = (step if onset is None else onset) if behind else None
    return onset if onset is not None else max(len(mine) - 1, 0)


def kill_loss_spike(loss: Sequence[float], *, patience: int = 4, outlier_multiplier: float = 2,
                    window_size: int = 100, loss_cap: float = 10) -> int | None:
    """The first step llm-foundry's ``KillLossSpike.batch_end`` would report (a spike for more
    than ``patience`` steps, or persistently high losses), or None."""
    window: deque[float] = deque(maxlen=window_size)
    outliers = 0
    for step, value in enumerate(loss):
        if len(window) == window_size:
            running = sum(window) / len(window)
            if value >= running * outlier_multiplier:  # detect_loss_spike
                outliers += 1
                if outliers > patience:
                    return step
            else:
                outliers = 0
            # detect_high_losses, its elif: whenever no spike was reported
            if step >= window_size * 2 and sum(1 for v in window if v > loss_cap) >= window_size / 2:
                return step
        window.append(value)
    return None


def _is_spike(value: float, history: Sequence[float], window_size: int, threshold_std: float) -> bool:
    if len(history) < window_size:
        return False
    mean = sum(history) / len(history)
    std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
    return std >= 1e-10 and value > mean + threshold_std * std


def olmo_stability_monitor(loss: Sequence[float], grad_norm: Sequence[float] | None = None, *,
                           window_size: int = 128, threshold_std: float = 6.0) -> int | None:
    """The first step OLMo-core's ``StabilityMonitorCallback`` counts as a spike (the loss or the
    gradient norm above the mean + ``threshold_std`` population standard deviations of its last
    ``window_size`` values), or None."""
    series = [loss] + ([grad_norm] if grad_norm is not None else [])
    histories: list[deque[float]] = [deque(maxlen=window_size) for _ in series]
    for step in range(len(loss)):
        hit = False
        for values, history in zip(series, histories, strict=True):
            hit = _is_spike(values[step], history, window_size, threshold_std) or hit
            history.append(values[step])
        if hit:
            return step
    return None
