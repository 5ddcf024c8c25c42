"""Read logged scalars back, as ``{tag: [(step, value), ...]}`` sorted by step, from TensorBoard event
files or a CSVLogger's ``metrics.csv``.  Where a resumed run logged a step twice, the later value wins."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

from lnmonitor.core.output.metric_names import unsplit

__all__ = ["event_file_problem", "event_files", "find_runs", "read_csv_scalars", "read_run", "read_scalars"]

Curves = dict[str, list[tuple[int, float]]]
CSV_NAME = "metrics.csv"  # what Lightning's CSVLogger writes


def event_files(folder: Path) -> list[Path]:
    """The TensorBoard event files directly in ``folder``, oldest first."""
    return sorted(Path(folder).glob("events.out.tfevents.*"))


def find_runs(logdir: Path) -> list[Path]:
    """The folders at or under ``logdir`` that hold event files or a ``metrics.csv``, in path order."""
    patterns = ("events.out.tfevents.*", CSV_NAME)
    return sorted({p.parent for pattern in patterns for p in Path(logdir).rglob(pattern) if p.is_file()})


def event_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a readable event file (TensorBoard skips such a file in silence), or None.
    A last record cut short is no problem: that is a run still writing."""
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    if Path(path).stat().st_size == 0:
        return None
    reader = PyRecordReader_New(str(path))
    records = 0
    try:
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:
                break
            except errors.DataLossError as err:
                cut = "truncated" in str(err)
                if cut and records:
                    break
                return f"record {records + 1} {'is cut short' if cut else 'fails its crc32 check'}"
            records += 1
    finally:
        reader.file_handle.close()
    return None


def read_run(folder: Path) -> Curves:
    """A run's scalars, from its event files when it has some, else from its ``metrics.csv``; a
    transformers.Trainer run's ``train/lnmonitor/...`` reads as ``lnmonitor/...`` (:func:`unsplit`)."""
    folder = Path(folder)
    if event_files(folder):
        curves = read_scalars(folder)
    else:
        curves = read_csv_scalars(folder / CSV_NAME) if (folder / CSV_NAME).is_file() else {}
    out: dict[str, dict[int, float]] = {}
    for tag in sorted(curves, key=lambda t: unsplit(t) == t):  # split tags first: a step logged both ways
        out.setdefault(unsplit(tag), {}).update(curves[tag])  # keeps the plain name's value
    return {tag: sorted(points.items()) for tag, points in out.items()}


def read_scalars(folder: Path, keep: Callable[[str], bool] = lambda tag: True) -> Curves:
    """Every scalar tag ``keep`` accepts, from the event files directly in ``folder`` (none sampled away)."""
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


def read_csv_scalars(path: Path) -> Curves:
    """The same from a CSVLogger's ``metrics.csv`` (empty cells: steps where a metric was not logged)."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    curves: dict[str, dict[int, float]] = {}
    for row in rows:
        try:
            step = int(float(row.get("step", "")))
        except ValueError:
            continue
        for tag, cell in row.items():
            if tag in ("step", "epoch") or cell in ("", None):
                continue
            try:
                value = float(cell)
            except ValueError:
                continue
            if math.isfinite(value):
                curves.setdefault(tag, {})[step] = value
    return {tag: sorted(points.items()) for tag, points in curves.items()}
