"""lnmonitor.experiments.report on synthetic records: what the report says of its own wall time."""

import pytest

from lnmonitor.experiments import report


def run(end: str, train: float, measure: float = 0.0) -> dict:
    return {"finished": f"2026-12-01T{end}+0000", "train_seconds": train, "measure_seconds": measure}


def test_runs_side_by_side_occupy_the_wall_time_once():
    # two runs trained side by side (10:00:00 to 10:01:40 and 10:00:00 to 10:02:30), one an hour later
    side_by_side = [run("10:01:40", 100.0), run("10:02:30", 100.0, 50.0)]
    later = [run("11:00:00", 60.0)]
    assert report.occupied_seconds(side_by_side + later) == pytest.approx(150.0 + 60.0)
    assert report.occupied_seconds(side_by_side[:1]) == pytest.approx(100.0)
    assert report.occupied_seconds([{"train_seconds": 5.0}]) == 0.0  # no finish time: no span
