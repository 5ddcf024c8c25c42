"""lnmonitor.experiments.eps.report and its figures on synthetic records: the wall time, the tables and
the verdict against scipy on the records, and what the heatmap and the dose-response draw."""

import pytest

from lnmonitor.experiments.eps import report


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures report_figures saves, kept as matplotlib figures instead of PNGs."""
    from lnmonitor.experiments.eps import report_figures

    figures: list = []
    monkeypatch.setattr(report_figures, "save_png", lambda fig, path: figures.append(fig))
    return figures


def run(end: str, train: float, measure: float = 0.0) -> dict:
    return {"finished": f"2026-12-01T{end}+0000", "train_seconds": train, "measure_seconds": measure}


def test_runs_side_by_side_occupy_the_wall_time_once():
    # two runs trained side by side (10:00:00 to 10:01:40 and 10:00:00 to 10:02:30), one an hour later
    side_by_side = [run("10:01:40", 100.0), run("10:02:30", 100.0, 50.0)]
    later = [run("11:00:00", 60.0)]
    assert report.occupied_seconds(side_by_side + later) == pytest.approx(150.0 + 60.0)
    assert report.occupied_seconds(side_by_side[:1]) == pytest.approx(100.0)
    assert report.occupied_seconds([{"train_seconds": 5.0}]) == 0.0  # no finish time: no span


def test_the_heatmap_takes_the_largest_eps_that_has_finished(tmp_path, drawn):
    import numpy as np

    from lnmonitor.experiments.eps import report_figures

    norms = ["model.blocks.0.ln1", "model.lnf"]

    def record(eps, values):
        curves = {f"lnmonitor/transmission/{n}": [[0, v], [50, v / 2]]
                  for n, v in zip(norms, values, strict=True)}
        return {"eps": eps, "seed": 0, "norm_order": norms, "curves": curves}

    # two finished eps (1e-5, 0.1) with different curves, and 1.0 not finished: the heatmap is 0.1's
    records = {(1e-5, 0): record(1e-5, [1e-6, 2e-6]), (0.1, 0): record(0.1, [0.5, 0.25])}
    assert report_figures.figure_transmission_by_norm(records, [1e-5, 0.1, 1.0], tmp_path / "heat.png")
    (ax, _) = drawn[0].axes
    assert ax.get_title().startswith("eps=0.1:")
    np.testing.assert_allclose(ax.images[0].get_array(), np.log10([[0.5, 0.25], [0.25, 0.125]]))
    assert not report_figures.figure_transmission_by_norm({}, [1e-5, 1.0], tmp_path / "none.png")


def test_the_report_tables_are_the_statistics_of_the_records(tmp_path):
    """The per-eps tables and the paired table: each figure's mean and 95% interval across the
    records' seeds (geometric for a figure positive by nature), and the difference paired by seed,
    against scipy on the raw values of the records on disk."""
    import numpy as np
    from scipy import stats

    from lnmonitor.core.output import files
    from lnmonitor.experiments.eps import store

    # seeds far apart, the eps effect small and steady within a seed: resolved only when paired by seed
    base = {0: 1.50, 1: 1.70, 2: 1.62}
    delta = {0: 0.030, 1: 0.040, 2: 0.035}
    transmission = {(1e-5, 0): 2e-6, (1e-5, 1): 5e-6, (1e-5, 2): 1e-6,
                    (0.1, 0): 0.3, (0.1, 1): 0.6, (0.1, 2): 0.2}
    config = {"recipe": {"width": 32}}
    for (eps, seed), t in transmission.items():
        loss = base[seed] + (delta[seed] if eps == 0.1 else 0.0)
        files.atomic_write_json(store.run_dir(tmp_path, eps, seed) / store.RECORD_NAME, {
            "format": store.RECORD_FORMAT, "config": config, "eps": eps, "seed": seed, "steps": 10,
            "val_loss": loss, "headline": {"val_loss": loss, "final_transmission": t}})
    results = report.merge_results(tmp_path, config, list(transmission))
    text = report.render_markdown(results, {}, tmp_path)

    def t_interval(values, log=False):
        y = np.log(values) if log else np.asarray(values, dtype=float)
        lo, hi = stats.t.interval(0.95, len(y) - 1, loc=y.mean(), scale=stats.sem(y))
        return (np.exp([y.mean(), lo, hi]) if log else (y.mean(), lo, hi)), (hi - lo) / 2

    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")}
    for eps, label in ((1e-5, "1e-05"), (0.1, "0.1")):
        losses = [base[s] + (delta[s] if eps == 0.1 else 0.0) for s in range(3)]
        (mean, lo, hi), _ = t_interval(losses)
        assert f"| validation loss (nats/char) | {mean:.4f} | {lo:.4f} to {hi:.4f} | 3 |" in sections[
            f"eps = {label}"]
        (mean, lo, hi), _ = t_interval([transmission[(eps, s)] for s in range(3)], log=True)
        row = (f"| final norm: transmission eps/(var+eps), median row (geometric mean) | {mean:.3g} | "
               f"{lo:.3g} to {hi:.3g} | 3 |")
        assert row in sections[f"eps = {label}"], sections[f"eps = {label}"]
    diffs = [delta[s] for s in range(3)]
    (mean, lo, hi), half = t_interval(diffs)
    assert (f"| 0.1 | {mean:+.4f} | {lo:+.4f} to {hi:+.4f} | 3 | 0: +0.0300, 1: +0.0400, 2: +0.0350 |"
            in text)
    relative = mean / np.mean(list(base.values()))
    assert (f"- eps=0.1 is worse than eps=1e-05 by {mean:.4f} +/- {half:.4f} nats/char, "
            f"{100 * relative:.1f}% of the eps=1e-05 loss" in sections["Verdict"])


def test_the_dose_response_draws_each_eps_means_over_its_seeds(tmp_path, drawn):
    """The three panels against eps: the loss's mean over seeds, the geometric mean of the first
    and the final norm's transmission, the mean attenuation and growth, each at its own eps
    (given out of order), from records whose seeds differ; fewer than three eps draw nothing."""
    import numpy as np

    from lnmonitor.experiments.eps import report_figures

    rng = np.random.default_rng(0)
    eps_values = [0.1, 1e-5, 1e-3]
    records = {(e, s): {"eps": e, "seed": s, "headline": {
        "val_loss": 1.5 + e + 0.1 * s, "first_transmission": (0.1 + e) * 10.0**-s, "final_transmission":
        (0.01 + e) * rng.uniform(0.1, 1.0), "attenuation": 3.0 + 10 * e + s, "growth": 5.0 - 10 * e + 2 * s,
    }} for e in eps_values for s in range(3)}
    assert report_figures.figure_dose_response(records, eps_values, tmp_path / "dose.png")
    ax_loss, ax_t, ax_l = drawn[0].axes
    order = sorted(eps_values)

    def mean(key, log=False):
        values = [[records[(e, s)]["headline"][key] for s in range(3)] for e in order]
        return np.exp(np.mean(np.log(values), axis=1)) if log else np.mean(values, axis=1)

    errorbars = [line for line in ax_loss.lines if line.get_marker() == "o"]  # one mean per eps
    np.testing.assert_allclose([line.get_xdata()[0] for line in errorbars], order)
    np.testing.assert_allclose([line.get_ydata()[0] for line in errorbars], mean("val_loss"), rtol=1e-12)
    lines = {line.get_label(): line for line in ax_t.lines + ax_l.lines}
    for label, key, log in (("first norm", "first_transmission", True),
                            ("final norm", "final_transmission", True),
                            ("attenuation", "attenuation", False), ("growth", "growth", False)):
        np.testing.assert_allclose(lines[label].get_xdata(), order)
        np.testing.assert_allclose(lines[label].get_ydata(), mean(key, log), rtol=1e-12, err_msg=label)
    two = {k: r for k, r in records.items() if k[0] != 0.1}
    assert not report_figures.figure_dose_response(two, eps_values, tmp_path / "none.png")


def test_the_ladder_and_share_figures_draw_each_runs_held_out_figures(tmp_path, drawn):
    """Records of the meter's result (format /2) whose first norm normalises the embeddings (no
    rung): the ladder draws each run's rungs' 1/sigma, one line per seed; the share bars are each
    norm's mean over seeds, with the records' random baseline."""
    import numpy as np
    from matplotlib.container import BarContainer

    from lnmonitor.experiments.eps import report_figures, store

    norms, rungs = ["model.emb", "model.ln1", "model.lnf"], ["model.ln1", "model.lnf"]

    def record(eps, seed):
        scale = (1 + seed) * (1 + eps)
        metrics = {f"lnmonitor/{stat}/{n}": (i + 1) * scale * (10 if stat == "inv_sigma" else 0.1)
                   for stat in ("inv_sigma", "share_median") for i, n in enumerate(norms)}
        metrics["lnmonitor/share_baseline/median"] = 0.125
        info = {n: {"kind": "layer", "width": 128, "eps": eps, "role": role, "dead_dim": 2}
                for n, role in zip(norms, ("embedding", "residual", "final"), strict=True)}
        return {"format": store.RECORD_FORMAT, "eps": eps, "seed": seed, "metrics": metrics,
                "norm_order": norms, "norm_info": info, "rungs": rungs, "final_norm": "model.lnf"}

    eps_values = [1e-5, 0.1]
    records = {(e, s): record(e, s) for e in eps_values for s in (0, 1)}
    assert report_figures.figure_ladder(records, eps_values, tmp_path / "ladder.png")
    (ax,) = drawn.pop().axes
    lines = sorted(tuple(line.get_ydata()) for line in ax.lines)
    assert lines == sorted(tuple(r["metrics"][f"lnmonitor/inv_sigma/{n}"] for n in rungs)
                           for r in records.values())
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ln1", "lnf"]
    assert report_figures.figure_shares(records, eps_values, tmp_path / "shares.png")
    (ax,) = drawn.pop().axes
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    for container, eps in zip(bars, eps_values, strict=True):
        heights = [bar.get_height() for bar in container]
        expected = [np.mean([records[(eps, s)]["metrics"][f"lnmonitor/share_median/{n}"] for s in (0, 1)])
                    for n in norms]
        np.testing.assert_allclose(heights, expected, rtol=1e-12)
    baseline = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(baseline) == 1 and baseline[0].get_ydata()[0] == 0.125


def test_the_invariance_figure_draws_each_runs_scale_3_error_as_its_absolute_value(tmp_path, drawn):
    """The right panel: one point per run at its final norm's eps/var, the output residual and
    abs(delta loss) of the scale-3 case; a delta-loss is signed (scaling can lower the loss), so
    a run whose loss fell is drawn at its absolute value, not left out."""
    import numpy as np

    from lnmonitor.experiments.eps import report_figures

    head = {(1e-5, 0): (1e-7, 4e-7, -2.4e-7), (1e-5, 1): (2e-7, 8e-7, 4.8e-7), (0.1, 0): (0.05, 0.2, -0.01)}
    records = {(e, s): {"eps": e, "seed": s, "headline": {
        "final_eps_over_var": x, "out_residual_scale_3": residual, "dloss_scale_3": dloss}}
        for (e, s), (x, residual, dloss) in head.items()}
    assert report_figures.figure_invariance(records, [1e-5, 0.1], tmp_path / "invariance.png")
    ax_runs = drawn[0].axes[1]
    points = {c.get_label(): sorted(map(tuple, c.get_offsets().tolist())) for c in ax_runs.collections}
    for eps, label in ((1e-5, "1e-05"), (0.1, "0.1")):
        runs = [v for (e, _), v in sorted(head.items()) if e == eps]
        assert points[f"output residual, eps={label}"] == sorted((x, r) for x, r, _ in runs)
        np.testing.assert_allclose(points[f"abs(delta loss), eps={label}"],
                                   sorted((x, abs(d)) for x, _, d in runs), rtol=1e-12)


def test_the_validation_loss_figure_draws_one_line_per_seed_labelled_once_per_eps(tmp_path, drawn):
    from lnmonitor.experiments.eps import report_figures

    curves = {(1e-5, 0): [(9, 3.0), (19, 2.5)], (1e-5, 1): [(9, 3.1), (19, 2.6)],
              (0.1, 0): [(9, 3.2), (19, 2.9)], (0.1, 1): []}  # a run without a curve yet: no line
    assert report_figures.figure_val_loss(curves, [1e-5, 0.1], tmp_path / "val.png")
    (ax,) = drawn[0].axes
    lines = [(tuple(ln.get_xdata()), tuple(ln.get_ydata()), ln.get_color()) for ln in ax.lines]
    assert sorted(x[:2] for x in lines) == sorted((tuple(s for s, _ in c), tuple(v for _, v in c))
                                                  for c in curves.values() if c)
    colour = {y: c for _, y, c in lines}
    assert colour[(3.0, 2.5)] == colour[(3.1, 2.6)] != colour[(3.2, 2.9)]  # one colour per eps
    assert ax.get_legend_handles_labels()[1] == ["eps=1e-05", "eps=0.1"]
    assert not report_figures.figure_val_loss({(1e-5, 0): []}, [1e-5], tmp_path / "none.png")


def test_the_invariance_figure_draws_each_sweep_and_its_fit_over_the_fitted_points(tmp_path, drawn):
    """The left panel: every point whose loss moved at abs(delta loss), and the run's fitted line
    ``constant * (eps/var)^slope`` over the eps/var of its fitted points only."""
    import numpy as np

    from lnmonitor.experiments.eps import report_figures

    sweep = [  # (eps/var, dloss, in fit, float32 rounding)
        (1e-7, 3e-7, False, True), (1e-4, 2e-5, True, False), (1e-2, -1.9e-3, True, False),
        (1.0, 0.2, True, False), (100.0, 0.5, False, False), (0.5, 0.0, False, False),
    ]
    keys = ("eps_over_var", "dloss", "in_fit", "rounding")
    record = {"eps": 1e-5, "seed": 0, "headline": {"scale_slope": 0.97, "scale_constant": 0.2},
              "invariance": {"sweep": [dict(zip(keys, p, strict=True)) for p in sweep]}}
    assert report_figures.figure_invariance({(1e-5, 0): record}, [1e-5], tmp_path / "invariance.png")
    ax = drawn[0].axes[0]
    points = sorted(tuple(xy) for c in ax.collections for xy in c.get_offsets().tolist())
    assert points == sorted((x, abs(d)) for x, d, _, _ in sweep if d != 0)  # the unmoved loss: no log
    (fit,) = ax.lines
    x = fit.get_xdata()
    assert x[0] == pytest.approx(1e-4) and x[-1] == pytest.approx(1.0)
    np.testing.assert_allclose(fit.get_ydata(), 0.2 * x**0.97, rtol=1e-12)


def test_the_report_command_checks_every_folder_before_writing(tmp_path, capsys):
    from lnmonitor.commands.cli import main
    from lnmonitor.core.output import files
    from lnmonitor.experiments.eps import store

    folder, config, pairs = tmp_path / "a", {"recipe": {}}, [[1e-5, 0], [0.1, 0]]
    for eps, seed in pairs:
        files.atomic_write_json(store.run_dir(folder, eps, seed) / store.RECORD_NAME, {
            "format": store.RECORD_FORMAT, "config": config, "eps": eps, "seed": seed, "steps": 10,
            "val_loss": 1.0, "headline": {"val_loss": 1.0}})
    files.atomic_write_json(folder / store.RESULTS_NAME, {
        "format": store.RESULTS_FORMAT, "config": config, "grid": {"pairs": pairs}})
    assert main(["report", str(folder), str(tmp_path / "missing")]) == 2
    assert "'" + str(tmp_path / "missing") + "' is not a folder" in capsys.readouterr().err
    assert not (folder / "report.md").exists()  # nothing written: the second folder was bad
    assert main(["report", str(folder), str(folder)]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["report", str(folder)]) == 0 and (folder / "report.md").is_file()
