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


def test_the_heatmap_takes_the_largest_eps_that_has_finished(tmp_path):
    from lnmonitor.experiments.report_figures import figure_transmission_by_norm

    norms = ["model.blocks.0.ln1", "model.lnf"]
    curves = {f"lnmonitor/transmission/{n}": [[0, 0.5], [50, 0.4]] for n in norms}
    records = {(0.1, 0): {"eps": 0.1, "seed": 0, "norm_order": norms, "curves": curves}}
    assert figure_transmission_by_norm(records, [1e-5, 0.1, 1.0], tmp_path / "heat.png")  # 1.0 not finished
    assert (tmp_path / "heat.png").stat().st_size > 0
    assert not figure_transmission_by_norm({}, [1e-5, 1.0], tmp_path / "none.png")
