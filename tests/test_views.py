"""The views people look at: the ladder picture and the heatmap, the one-screen summary,
the bounded curves a monitor keeps for them, and the pictures reaching the loggers."""

from __future__ import annotations

import logging
import math
import re
import warnings

import numpy as np
from conftest import NORMS, MemoryLogger, char_data, events, trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.views.pictures import heatmap_picture, ladder_picture
from lnmonitor.views.summary import RunCurves, ladder_grid, ladder_of, summary_text

BLUE, RED = (31, 119, 180), (200, 30, 30)


def test_run_curves_keep_first_and_last_points_and_a_bounded_evenly_thinned_series():
    kept = RunCurves(series=("s/",), max_points=8)
    for step in range(0, 1000, 10):
        kept.add(step, {"s/a": 2.0 * step, "o/b": -float(step)})
    curves = kept.curves()
    assert curves["o/b"] == [(0, 0.0), (990, -990.0)]
    steps = [s for s, _ in curves["s/a"]]
    assert steps[0] == 0 and steps[-1] == 990 and len(steps) <= 9
    assert len({b - a for a, b in zip(steps[:-2], steps[1:-1], strict=True)}) == 1  # one stride
    assert all(v == 2.0 * s for s, v in curves["s/a"])


def _blobs(mask: np.ndarray, tall: int = 6) -> list[tuple[float, float]]:
    """``(x, y)`` centres of the markers: runs of columns with at least ``tall`` pixels set."""
    columns = np.nonzero(mask.sum(0) >= tall)[0]
    runs = np.split(columns, np.nonzero(np.diff(columns) > 1)[0] + 1)
    return [(float(r.mean()), float(np.nonzero(mask[:, r].any(1))[0].mean())) for r in runs if len(r)]


def test_ladder_picture_puts_each_rung_at_its_value_on_a_log_scale_and_marks_the_final_norm():
    picture = ladder_picture(["a.0", "a.1", "a.2"], [1.0, 0.1, 0.01], [100.0, 100.0, 100.0], final="a.2")
    assert picture.shape == (320, 480, 3) and picture.dtype == np.uint8
    markers = [(x, y) for x, y in _blobs(np.all(picture == BLUE, axis=-1)) if y > 44]  # not the legend
    assert len(markers) == 3
    (x0, y0), (x1, y1), (x2, y2) = markers
    assert x0 < x1 < x2 and y0 < y1 < y2  # smaller 1/sigma lower down
    assert abs((y1 - y0) - (y2 - y1)) <= 2  # equal ratios, equal steps: a log axis
    red = np.all(picture == RED, axis=-1)
    final_column = int(np.argmax(red.sum(0)))
    assert red[:, final_column].sum() > 100 and abs(final_column - x2) <= 2
    blank = ladder_picture([], [], [])
    assert blank.shape == (320, 480, 3)  # says "no rung measured yet"


def test_heatmap_picture_takes_uneven_steps_and_missing_cells():
    values = np.array([[1.0, 0.9, np.nan], [0.5, 0.4, 0.3]])
    picture = heatmap_picture(["x", "y"], [0, 10, 29], values, "t")
    assert picture.ndim == 3 and picture.shape[2] == 3 and picture.dtype == np.uint8
    assert heatmap_picture(["x"], [5], np.array([[2.0]])).shape[2] == 3  # one step


def test_summary_orders_rungs_by_their_ladder_position_and_says_what_is_missing():
    p = "lnmonitor"
    curves = {
        f"{p}/inv_sigma/m.z_first": [(0, 2.0), (10, 1.5)],
        f"{p}/inv_sigma/m.a_last": [(10, 0.25)],
        f"{p}/inv_sigma/m.q": [(10, 3.0)],
        f"{p}/ladder_position/m.z_first": [(0, 0.0)],
        f"{p}/ladder_position/m.a_last": [(0, 1.0)],
        f"{p}/ladder_position/m.q": [(0, -1.0)],
        f"{p}/ladder/attenuation": [(0, 4.0), (10, 6.0)],
        f"{p}/invariance/shift_5/dloss": [(11, 0.0)],
        f"{p}/invariance/scale_3/dloss": [(11, 2.5e-7)],
    }
    assert ladder_of(curves) == (["m.z_first", "m.a_last"], ["m.q"])
    text = summary_text(curves, "run")
    rows = [line.split()[0] for line in text.splitlines() if line.startswith(("  z_", "  a_", "  q "))]
    assert rows == ["z_first", "a_last", "q"]  # without the shared "m."
    assert "(not a rung)" in next(line for line in text.splitlines() if line.startswith("  q "))
    assert "attenuation (1/sigma of the first rung / the last): 6x, 4x at step 0" in text
    assert "the ladder at step 10 (2 measured steps, the first at 0; names without 'm.')" in text
    dloss_row = next(line for line in text.splitlines() if "delta-loss" in line)
    assert dloss_row.split()[-2:] == ["0", "2.5e-07"]  # an exact zero reads 0
    rungs, steps, grid = ladder_grid(curves)
    assert steps == [0, 10] and np.isnan(grid[1, 0]) and grid[0, 1] == 1.5
    assert summary_text({}, "run") == "run: no lnmonitor metric logged"


class PictureLogger(MemoryLogger):
    """A logger that takes pictures the way W&B's and Neptune's do."""

    def __init__(self, broken: bool = False):
        super().__init__()
        self.broken, self.pictures = broken, []

    def log_image(self, key, images, step=None):
        if self.broken:
            raise RuntimeError("no room for pictures")
        self.pictures.append((key, step, images[0].shape))


def test_pictures_reach_every_logger_that_takes_them_and_the_summary_matches_the_log(tmp_path, caplog):
    data, module = char_data(5)
    ln = LayerNormMonitor(every_n_steps=2, image_every_n_steps=2, keep_history=True)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=10, on_validation=False, keep_history=True)
    tb, takes, broken = TensorBoardLogger(tmp_path, name="tb"), PictureLogger(), PictureLogger(broken=True)
    t = trainer(5, [ln, inv], logger=[tb, takes, broken])
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module, datamodule=data)
    assert t.global_step == 5  # a logger that fails on pictures stops nothing
    measured = [h["step"] for h in ln.history]
    assert measured == [0, 2, 4]
    acc = events(tb.log_dir)
    assert [e.step for e in acc.Images("lnmonitor/ladder")] == measured
    assert [e.step for e in acc.Images("lnmonitor/ladder_over_training")] == [4]
    assert [(k, s) for k, s, _ in takes.pictures] == [("lnmonitor/ladder", s) for s in measured] + [
        ("lnmonitor/ladder_over_training", 4)]
    assert takes.pictures[0][2] == (320, 480, 3)
    said = [str(w.message) for w in caught if "pictures not logged to PictureLogger" in str(w.message)]
    assert len(said) == 1 and "no room for pictures" in said[0]

    said = [r.getMessage() for r in caplog.records]
    text = next(m for m in said if m.startswith("lnmonitor summary: Tiny"))
    last = ln.history[-1]
    for name in NORMS:  # the printed 1/sigma is the last logged one, to three figures
        row = next(line for line in text.splitlines() if line.startswith(f"  {name.removeprefix('model.')} "))
        assert math.isclose(float(row.split()[1]), last[f"lnmonitor/inv_sigma/{name}"], rel_tol=5e-3)
    # the invariance monitor probes the point after the last update at the end of the fit
    assert [h["step"] for h in inv.history] == [0, 5]
    inv_text = next(m for m in said if m.startswith("lnmonitor summary: final norm 'model.lnf'"))
    assert re.search(r"final-norm invariance at step 5 ", inv_text)


def test_pictures_are_spaced_by_image_every_n_steps_and_the_last_step_always_has_one(tmp_path):
    data, module = char_data(8)
    ln = LayerNormMonitor(every_n_steps=1, image_every_n_steps=3, summary=False)
    tb = TensorBoardLogger(tmp_path, name="tb")
    trainer(8, [ln], logger=tb).fit(module, datamodule=data)
    acc = events(tb.log_dir)
    assert sorted({e.step for e in acc.Scalars("lnmonitor/inv_sigma/model.lnf")}) == list(range(8))
    assert [e.step for e in acc.Images("lnmonitor/ladder")] == [0, 3, 6, 7]


def test_images_and_summary_are_off_with_one_argument(tmp_path, caplog):
    data, module = char_data(3)
    tb = TensorBoardLogger(tmp_path, name="tb")
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(3, [LayerNormMonitor(every_n_steps=1, images=False, summary=False)], logger=tb).fit(
            module, datamodule=data)
    acc = events(tb.log_dir)
    assert acc.Tags()["images"] == [] and "lnmonitor/inv_sigma/model.lnf" in acc.Tags()["scalars"]
    assert not any("lnmonitor summary" in r.getMessage() for r in caplog.records)


def test_the_pictures_name_rungs_as_the_summary_does(monkeypatch):
    """A GPT-2 held as a LightningModule's ``self.model``: its rungs share ``model.transformer.``,
    and the step picture labels them without it, as the summary's table does (both dropped
    only ``model.`` before: the picture read ``transformer.h.0.ln_1`` where the text read
    ``h.0.ln_1``)."""
    from lnmonitor.core.meter.meter import ladder_figures, norm_figures
    from lnmonitor.core.meter.row_stats import RowStats
    from lnmonitor.core.output.metric_names import per_norm
    from lnmonitor.views import pictures

    names = ["model.transformer.h.0.ln_1", "model.transformer.h.0.ln_2", "model.transformer.ln_f"]
    stats = [RowStats(rows=1, share_rows=0, share_median=math.nan, share_p90=math.nan, var_median=1.0 + i,
                      ms_median=1.0 + i, share_max=math.nan, layout=None) for i in range(3)]
    norms = [norm_figures(n, "layer", 8, 1e-5, s) for n, s in zip(names, stats, strict=True)]
    figures = ladder_figures(norms, names, names[-1])
    drawn = {}
    monkeypatch.setattr(pictures, "ladder_picture", lambda labels, inv, rms, final, title: drawn.update(
        labels=labels, final=final))
    pictures.step_picture(figures, 3)
    assert drawn == {"labels": ["h.0.ln_1", "h.0.ln_2", "ln_f"], "final": "ln_f"}
    curves = {per_norm(tag, n): [(3, 1.0)] for n in names for tag in ("inv_sigma", "rms")}
    curves.update({per_norm("ladder_position", n): [(3, float(i))] for i, n in enumerate(names)})
    table = summary_text(curves)
    assert all(re.search(rf"^  {re.escape(label)} ", table, re.M) for label in drawn["labels"]), table


def test_summarize_share_figure_draws_each_norms_last_shares_in_ladder_order(tmp_path, monkeypatch):
    """Each norm's median, p90 and max share at its last logged step (not its first), rungs in
    ladder order then the others, against the run's last random baseline."""
    from lnmonitor.views import summary_figures

    p = "lnmonitor"
    curves = {f"{p}/ladder_position/m.b": [(0, 0.0)], f"{p}/ladder_position/m.a": [(0, 1.0)],
              f"{p}/ladder_position/m.c": [(0, -1.0)], f"{p}/share_baseline/median": [(0, 0.2), (10, 0.25)],
              f"{p}/share_baseline/max": [(0, 0.6), (10, 0.65)]}
    for i, name in enumerate(("m.b", "m.a", "m.c")):
        curves[f"{p}/inv_sigma/{name}"] = [(0, 1.0), (10, 1.0)]
        for j, stat in enumerate(("share_median", "share_p90", "share_max")):
            curves[f"{p}/{stat}/{name}"] = [(0, 0.9), (10, 0.1 * (i + 1) + 0.2 * j)]
    figures = []
    monkeypatch.setattr(summary_figures, "save_png", lambda fig, path: figures.append(fig))
    assert summary_figures.figure_shares(curves, "run", tmp_path / "shares.png")
    (ax,) = figures[0].axes
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    order = ("m.b", "m.a", "m.c")  # the rungs by position, then the norm that is not one
    for stat, label in (("share_median", "median share"), ("share_p90", "p90 share"),
                        ("share_max", "max share")):
        assert lines[label] == [curves[f"{p}/{stat}/{n}"][-1][1] for n in order], label
    assert [t.get_text() for t in ax.get_xticklabels()] == ["b", "a", "c"]
    assert lines["random direction, median"][0] == 0.25 and lines["random direction, max"][0] == 0.65


def test_summarize_ladders_figure_draws_each_runs_last_ladder_in_rung_order(tmp_path, monkeypatch):
    from lnmonitor.views import summary_figures

    def run(values: dict) -> dict:
        curves = {f"lnmonitor/ladder_position/{n}": [(0, float(i))] for i, n in enumerate(values)}
        curves.update({f"lnmonitor/inv_sigma/{n}": [(0, 9.0), (10, v)] for n, v in values.items()})
        return curves

    runs = {"a": run({"m.z": 2.0, "m.y": 1.0, "m.x": 0.5}), "b": run({"m.z": 3.0, "m.y": 0.3, "m.x": 0.1}),
            "one rung": run({"m.z": 1.0})}
    figures = []
    monkeypatch.setattr(summary_figures, "save_png", lambda fig, path: figures.append(fig))
    assert summary_figures.figure_ladders(runs, tmp_path / "ladders.png")
    (ax,) = figures[0].axes
    assert {line.get_label(): list(line.get_ydata()) for line in ax.lines} == {
        "a": [2.0, 1.0, 0.5], "b": [3.0, 0.3, 0.1]}  # the last step's, by ladder position
    alone = {"a": runs["a"], "one rung": runs["one rung"]}  # one ladder to draw: no figure
    assert not summary_figures.figure_ladders(alone, tmp_path / "x.png")
