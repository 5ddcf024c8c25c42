"""Read logged scalars back: from TensorBoard event files or a CSVLogger's ``metrics.csv``.

:func:`read_scalars` returns ``{tag: [(step, value), ...]}`` with one value per step,
sorted by step.  A resumed run writes a second event file that repeats the steps after
its checkpoint; the later value of a step wins.  TensorBoard's own EventAccumulator is
used with nothing sampled away (``size_guidance`` 0 for scalars).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

__all__ = ["event_files", "read_csv_scalars", "read_scalars"]

Curves = dict[str, list[tuple[int, float]]]


def event_files(folder: Path) -> list[Path]:
    """The TensorBoard event files directly in ``folder``, oldest first."""
    return sorted(Path(folder).glob("events.out.tfevents.*"))


def read_scalars(folder: Path, keep: Callable[[str], bool] = lambda tag: True) -> Curves:
    """Every scalar tag ``keep`` accepts, from the event files directly in ``folder``
    (empty when there are none)."""
    folder = Path(folder)
    if not event_files(folder):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    curves: Curves = {}
    for tag in acc.Tags().get("scalars", []):
        if not keep(tag):
            continue
        by_step: dict[int, tuple[float, float]] = {}
        for event in acc.Scalars(tag):
            if event.step not in by_step or event.wall_time >= by_step[event.step][0]:
                by_step[event.step] = (event.wall_time, event.value)
        curves[tag] = [(step, value) for step, (_, value) in sorted(by_step.items())]
    return curves


def read_csv_scalars(path: Path, keep: Callable[[str], bool] = lambda tag: True) -> Curves:
    """The same from a CSVLogger's ``metrics.csv`` (one column per metric, a ``step``
    column; empty cells are steps where that metric was not logged)."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    curves: dict[str, dict[int, float]] = {}
    for row in rows:
        try:
            step = int(float(row.get("step", "")))
        except ValueError:
            continue
        for tag, cell in row.items():
            if tag in ("step", "epoch") or cell in ("", None) or not keep(tag):
                continue
            try:
                value = float(cell)
            except ValueError:
                continue
            if math.isfinite(value):
                curves.setdefault(tag, {})[step] = value
    return {tag: sorted(points.items()) for tag, points in curves.items()}
