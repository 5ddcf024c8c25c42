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


def test_the_heatmap_takes_the_largest_eps_that_has_finished(tmp_path, monkeypatch):
    import numpy as np

    from lnmonitor.experiments import report_figures

    norms = ["model.blocks.0.ln1", "model.lnf"]

    def record(eps, values):
        curves = {f"lnmonitor/transmission/{n}": [[0, v], [50, v / 2]]
                  for n, v in zip(norms, values, strict=True)}
        return {"eps": eps, "seed": 0, "norm_order": norms, "curves": curves}

    # two finished eps (1e-5, 0.1) with different curves, and 1.0 not finished: the heatmap is 0.1's
    records = {(1e-5, 0): record(1e-5, [1e-6, 2e-6]), (0.1, 0): record(0.1, [0.5, 0.25])}
    drawn = []
    monkeypatch.setattr(report_figures, "save_png", lambda fig, path: drawn.append(fig))
    assert report_figures.figure_transmission_by_norm(records, [1e-5, 0.1, 1.0], tmp_path / "heat.png")
    (ax, _) = drawn[0].axes
    assert ax.get_title().startswith("eps=0.1:")
    np.testing.assert_allclose(ax.images[0].get_array(), np.log10([[0.5, 0.25], [0.25, 0.125]]))
    assert not report_figures.figure_transmission_by_norm({}, [1e-5, 1.0], tmp_path / "none.png")
