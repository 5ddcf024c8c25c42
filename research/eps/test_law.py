"""research.eps.law: one law across eps comparisons, from tiny synthetic records
(no training): the predictors read from a record, the hinge fit, the bootstrap intervals,
the sentence that claims no more than them, and ``python -m research.eps A B --out C``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lnmonitor.core.output import files
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps import store
from lnmonitor.experiments.eps.statistics import paired_difference
from lnmonitor.experiments.eps.store import eps_label
from research.eps import law
from research.eps.__main__ import main

FIRST, FINAL = "model.blocks.0.ln1", "model.lnf"


def record(eps: float, seed: int, val_loss: float, var0: float, var_end: float) -> dict:
    """A run record with what the law reads (the first norm's eps/var curve, from var0 at step
    0 to var_end at step 100, and its held-out eps/var at the end) and what the report's
    figures draw."""
    curve = [[s, eps / (var0 + (var_end - var0) * s / 100)] for s in (0, 50, 100)]
    curves = {f"lnmonitor/{stat}/{norm}": [[s, v / (1 + v)] for s, v in curve]
              for stat in ("transmission", "rms") for norm in (FIRST, FINAL)}
    curves[f"lnmonitor/eps_over_var/{FIRST}"] = curve
    curves["val/loss"] = [[99, val_loss + 0.5], [100, val_loss]]
    norms = {FIRST: {"eps_over_var": eps / var_end, "inv_sigma": 2.0, "share_median": 0.1},
             FINAL: {"inv_sigma": 0.5, "share_median": 0.1}}
    return {"eps": eps, "seed": seed, "val_loss": val_loss, "headline": {"val_loss": val_loss},
            "norm_order": [FIRST, FINAL], "norms": norms, "curves": curves}


def grid(init: str, var: float, cost, eps_values=(1e-5, 1e-3, 1e-1, 10.0), seeds=range(4), noise=0.0):
    """Merged results of a grid whose first norm reads variance ``var``: the loss at eps is
    ``1.5 + cost(log10(eps/var))`` plus seed noise (the same at every eps of a seed, as pairing
    removes) and ``noise`` per run."""
    rng = np.random.default_rng(len(init))
    runs = {(e, s): record(e, s, 1.5 + 0.05 * s + cost(math.log10(e / var)) + noise * rng.standard_normal(),
                           var, var)
            for e in eps_values for s in seeds}
    base = min(eps_values)
    return {"config": {"recipe": {"init": init}}, "baseline_eps": base, "runs": list(runs.values()),
            "differences": {eps_label(e): paired_difference(runs, e, base) for e in eps_values if e != base}}


def hinge(knee: float, slope: float):
    return lambda x: slope * max(0.0, x - knee)


def test_the_predictors_read_step_0_the_curve_and_the_end():
    r = record(0.1, 0, 1.5, var0=1e-3, var_end=1e-1)
    assert law.eps_over_var_at_init(r) == pytest.approx(100.0)
    assert law.eps_over_var_at_end(r) == pytest.approx(1.0)
    values = [v for _, v in r["curves"][f"lnmonitor/eps_over_var/{FIRST}"]]
    assert law.eps_over_var_over_training(r) == pytest.approx(math.exp(np.mean(np.log(values))))
    r["curves"][f"lnmonitor/eps_over_var/{FIRST}"] = r["curves"][f"lnmonitor/eps_over_var/{FIRST}"][1:]
    assert law.eps_over_var_at_init(r) is None  # step 0 not logged: no value at initialisation


def test_the_hinge_fit_finds_the_knee_and_the_slope():
    x = np.linspace(-4.0, 4.0, 17)
    y = 0.02 * np.maximum(0.0, x - 1.0)
    knee, slope, sse = law.fit_hinge(x, y)
    assert knee == pytest.approx(1.0, abs=8.0 / law.KNEES) and slope == pytest.approx(0.02, rel=0.03)
    assert sse < 1e-6
    assert law.fit_hinge([0.0, 0.5, 0.9], [0.0, 0.0, 1.0]) is None  # less than a decade: no slope to carry


def test_two_initialisations_fall_on_one_law_and_the_intervals_cover_it():
    # the same hinge in log10(eps/var) (knee at 1, 0.02 per decade), reached by the small-variance
    # grid only: one grid alone cannot locate the knee, the two together do
    cost = hinge(1.0, 0.02)
    grids = {"big-var": grid("default", 1.0, cost, noise=0.002),
             "small-var": grid("gpt2", 1e-3, cost, noise=0.002)}
    result = law.law(grids, resamples=300)
    assert len(result["points"]) == 2 * 3 * 4
    fit = result["fits"]["init"]
    assert fit["spearman"] > 0.5 and fit["spearman_p"] < 0.01
    lo, hi = fit["knee_interval"]
    assert lo < 10.0 < hi and hi / lo < 10.0  # the knee at eps/var = 10, located within a decade
    assert fit["slope_interval"][0] < 0.02 < fit["slope_interval"][1]
    assert fit["slope_interval"][0] > 0 and fit["knee_at"] is None and len(fit["doses_carrying_slope"]) == 2
    assert law.sentence(fit).startswith("A large eps costs loss when the first norm's eps/var at step 0")


@pytest.mark.parametrize("truth", ["init", "mean", "end"])
def test_the_best_predictor_is_the_one_the_loss_follows(truth):
    """The loss follows eps/var at one moment; the small-variance grid's first norm reads a
    variance 1000x away at the others (the same hinge as above), so only the true predictor
    puts both grids on one law, and the best fit names it."""
    cost = hinge(1.0, 0.02)
    grids = {"big-var": grid("default", 1.0, cost, noise=0.002),
             "small-var": grid("gpt2", 1e-3, cost, noise=0.002)}
    # factors on the curve at steps 0, 50, 100 and on the held-out figure at the end: each wrong
    # predictor reads the small-variance grid 2 or 3 decades lower (higher would be one law, shifted)
    off = {"init": ((1, 1e-3, 1e-3), 1e-3), "mean": ((1e-3, 1e3, 1), 1e-3), "end": ((1e-3,) * 3, 1)}[truth]
    for r in grids["small-var"]["runs"]:
        for point, factor in zip(r["curves"][f"lnmonitor/eps_over_var/{FIRST}"], off[0], strict=True):
            point[1] *= factor
        r["norms"][FIRST]["eps_over_var"] *= off[1]
    result = law.law(grids, resamples=20)
    sd = {key: fit["residual_sd"] for key, fit in result["fits"].items()}
    assert result["best"] == truth and all(sd[truth] < 0.5 * v for k, v in sd.items() if k != truth), sd
    label = law.PREDICTORS[truth][0]
    assert f"Best (smallest residual sd): the {label}." in law.render_law(result, figure=False)


def test_a_slope_carried_by_one_dose_says_so():
    cost = hinge(1.0, 0.02)
    grids = {"big-var": grid("default", 1.0, cost, eps_values=(1e-5, 1e-3, 1e-1)),
             "small-var": grid("gpt2", 1e-3, cost, eps_values=(1e-5, 1e-3, 1e-1))}
    fit = law.law(grids, resamples=50)["fits"]["init"]
    assert fit["doses_carrying_slope"] == ["small-var eps=0.1"]
    assert "One dose carries the slope (small-var eps=0.1" in law.sentence(fit)


def test_noise_alone_is_no_resolved_cost():
    grids = {"a": grid("default", 1.0, lambda x: 0.0, noise=0.005),
             "b": grid("gpt2", 1e-3, lambda x: 0.0, noise=0.005)}
    fit = law.law(grids, resamples=300)["fits"]["init"]
    lo, hi = fit["slope_interval"]
    assert lo < 0 < hi
    assert law.sentence(fit).startswith("No cost resolved")


def test_too_few_points_is_a_one_line_error():
    one = grid("default", 1.0, lambda x: 0.0, eps_values=(1e-5, 1e-1), seeds=[0, 1])
    with pytest.raises(UsageError, match="at least 3 paired loss differences"):
        law.law({"a": one})


def test_write_law_writes_markdown_json_and_the_figure(tmp_path):
    cost = hinge(1.0, 0.02)
    grids = {"big-var": grid("default", 1.0, cost), "small-var": grid("gpt2", 1e-3, cost)}
    law.write_law(tmp_path, grids, resamples=100)
    text = (tmp_path / "law.md").read_text()
    assert "| big-var | default | 1e-05 | 12 |" in text and f"]({law.LAW_FIGURE})" in text
    assert json.loads((tmp_path / "law.json").read_text())["best"] in law.PREDICTORS
    assert (tmp_path / law.LAW_FIGURE).stat().st_size > 10_000


def write_folder(folder, init: str, var: float, cost) -> None:
    """An eps-compare --out folder holding the records of :func:`grid` and its results.json."""
    config = {"recipe": {"init": init}}
    results = grid(init, var, cost, seeds=range(3))
    for r in results["runs"]:
        r.update(format=store.RECORD_FORMAT, config=config, steps=100)
        files.atomic_write_json(store.run_dir(folder, r["eps"], r["seed"]) / store.RECORD_NAME, r)
    pairs = [[r["eps"], r["seed"]] for r in results["runs"]]
    files.atomic_write_json(folder / store.RESULTS_NAME, {
        "format": store.RESULTS_FORMAT, "config": config, "grid": {"pairs": pairs}})


def test_the_law_command_rebuilds_every_folder_and_writes_the_law(tmp_path, capsys):
    cost = hinge(1.0, 0.02)
    write_folder(tmp_path / "default", "default", 1.0, cost)
    write_folder(tmp_path / "gpt2", "gpt2", 1e-3, cost)
    code = main([str(tmp_path / "default"), str(tmp_path / "gpt2"), "--out", str(tmp_path / "law")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("rebuilt ") == 2 and (tmp_path / "gpt2" / "report.md").is_file()
    assert "A large eps costs loss when the first norm's eps/var" in out
    text = (tmp_path / "law" / "law.md").read_text()
    assert f"| {tmp_path / 'gpt2'} | gpt2 | 1e-05 | 9 |" in text
    assert main([str(tmp_path / "default"), str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a folder" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_the_law_reads_the_first_rungs_eps_over_var_at_the_end():
    """Of a record of the meter's metrics (format /2), the first rung's, not the first norm's."""
    metrics = {"lnmonitor/eps_over_var/emb": 3.0, "lnmonitor/eps_over_var/ln1": 0.25}
    info = {"emb": {"role": "embedding"}, "ln1": {"role": "residual"}}
    r = {"format": store.RECORD_FORMAT, "metrics": metrics, "norm_order": ["emb", "ln1"], "norm_info": info,
         "rungs": ["ln1"]}
    assert law.eps_over_var_at_end(r) == 0.25
