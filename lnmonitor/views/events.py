"""Read logged scalars back: from TensorBoard event files or a CSVLogger's ``metrics.csv``.

:func:`find_runs` lists the run folders under a log folder, :func:`event_file_problem`
says why an event file cannot be read (TensorBoard itself skips such a file in silence),
:func:`read_run` reads one run whichever logger wrote it.  :func:`read_scalars` returns
``{tag: [(step, value), ...]}`` with one value per step, sorted by step.  A resumed run
writes a second event file that repeats the steps after its checkpoint; the later value
of a step wins.  TensorBoard's own EventAccumulator is
used with nothing sampled away (``size_guidance`` 0 for scalars).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

from lnmonitor.core.output.metric_names import unsplit

__all__ = ["event_file_problem", "event_files", "find_runs", "read_csv_scalars", "read_run", "read_scalars"]

Curves = dict[str, list[tuple[int, float]]]
CSV_NAME = "metrics.csv"  # what Lightning's CSVLogger writes in each run's folder


def event_files(folder: Path) -> list[Path]:
    """The TensorBoard event files directly in ``folder``, oldest first."""
    return sorted(Path(folder).glob("events.out.tfevents.*"))


def find_runs(logdir: Path) -> list[Path]:
    """The folders at or under ``logdir`` that hold event files or a ``metrics.csv``, in
    path order (a TensorBoardLogger's ``name/version_N``, a CSVLogger's, ...)."""
    logdir = Path(logdir)
    found = {p.parent for p in logdir.rglob("events.out.tfevents.*") if p.is_file()}
    found |= {p.parent for p in logdir.rglob(CSV_NAME) if p.is_file()}
    return sorted(found)


def event_file_problem(path: Path) -> str | None:
    """Why ``path`` is not a readable event file -- a record failing its crc32 check, or
    bytes without one whole record -- or None.  A last record cut short is no problem: that
    is a run still writing."""
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
    """A run's scalars: from its event files when it has some, else from its ``metrics.csv``;
    lnmonitor's names as every monitor logs them (a transformers.Trainer run's ``train/`` split
    taken off: ``train/lnmonitor/...`` reads as ``lnmonitor/...``)."""
    folder = Path(folder)
    if event_files(folder):
        curves = read_scalars(folder)
    else:
        curves = read_csv_scalars(folder / CSV_NAME) if (folder / CSV_NAME).is_file() else {}
    return _unsplit(curves)


def _unsplit(curves: Curves) -> Curves:
    """``curves`` under :func:`~lnmonitor.core.output.metric_names.unsplit`'s names; a tag logged both
    ways keeps the points of the name without the split where both have the step."""
    out: dict[str, dict[int, float]] = {}
    for tag in sorted(curves, key=lambda t: unsplit(t) == t):  # split tags first, plain ones win
        out.setdefault(unsplit(tag), {}).update(curves[tag])
    return {tag: sorted(points.items()) for tag, points in out.items()}


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
