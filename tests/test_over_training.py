"""lnmonitor.experiments.eps.over_training: the loss gap paired by seed at every validation, the
first norm's transmission and the stream rms over training, from tiny synthetic curves."""

from __future__ import annotations

import pytest

from lnmonitor.experiments.eps import over_training

FIRST, FINAL = "model.blocks.0.ln1", "model.lnf"


def record(eps: float, seed: int, losses: dict, transmission: dict) -> dict:
    """Seed s scales its transmission and rms curves by 2^(s - 2): the seeds' geometric mean is
    neither any one seed's curve nor their arithmetic mean."""
    scale = 2.0 ** (seed - 2)
    rms = {s: scale * 0.1 * (1 + s / 100) for s in transmission}
    return {"eps": eps, "seed": seed, "norm_order": [FIRST, FINAL], "curves": {
        "val/loss": [[s, v] for s, v in losses.items()],
        f"lnmonitor/transmission/{FIRST}": [[s, scale * v] for s, v in transmission.items()],
        f"lnmonitor/rms/{FIRST}": [[s, v] for s, v in rms.items()],
        f"lnmonitor/rms/{FINAL}": [[s, 10 * v] for s, v in rms.items()],
    }}


def grid(gaps: list[float], seeds=(0, 1, 2)) -> dict:
    """eps 1e-5 and 0.1: seed s has loss 2 + 0.1 s - step/1000 at 1e-5 and that plus
    ``gaps[i]`` (+ 0.001 s) at the i-th validation (steps 100, 200, ...) at 0.1."""
    steps = [100 * (i + 1) for i in range(len(gaps))]
    out = {}
    for s in seeds:
        base = {st: 2 + 0.1 * s - st / 1000 for st in steps}
        out[(1e-5, s)] = record(1e-5, s, base, {0: 1e-3, 100: 4e-4, 200: 3e-4})
        larger = {st: base[st] + g + 0.001 * s for st, g in zip(steps, gaps, strict=True)}
        out[(0.1, s)] = record(0.1, s, larger, {0: 0.99, 100: 0.9, 200: 0.95})
    return out


def test_the_gap_is_paired_by_seed_at_every_validation():
    records = grid([0.5, 0.1, 0.0])
    gap = over_training.loss_gap(records, 0.1, 1e-5)
    assert [g["step"] for g in gap] == [100, 200, 300] and all(g["seeds"] == [0, 1, 2] for g in gap)
    assert [g["mean"] for g in gap] == pytest.approx([0.501, 0.101, 0.001])
    assert gap[0]["half_width"] == pytest.approx(gap[2]["half_width"])  # the seeds' 0.1 s offsets cancel


def test_a_validation_missing_from_one_run_is_left_out():
    records = grid([0.5, 0.1, 0.0])
    records[(0.1, 1)]["curves"]["val/loss"].pop(1)
    assert [g["step"] for g in over_training.loss_gap(records, 0.1, 1e-5)] == [100, 300]


def test_first_below_half_and_never():
    records = grid([0.5])
    tag = f"lnmonitor/transmission/{FIRST}"
    assert over_training.first_below_half(records[(1e-5, 0)], tag) == 100
    assert over_training.first_below_half(records[(0.1, 0)], tag) is None


def test_the_section_says_when_the_gap_is_resolved_and_what_the_first_norm_does():
    lines = "\n".join(over_training.markdown(grid([0.5, 0.2, 0.0]), [1e-5, 0.1], 1e-5))
    assert "eps=0.1 (3 paired seeds): first resolved at step 100, resolved at 2 of 3 validations" in lines
    # the seeds' geometric mean (scales 1/4, 1/2, 1: the mean curve is half the fixture's)
    assert "| 0.1 | 0.495 -> 0.45 at step 100 -> 0.475 | 0: never, 1: never, 2: never |" in lines
    assert "| 1e-05 | 0.0005 -> 0.00015 at step 200 -> 0.00015 | 0: 100, 1: 100, 2: 100 |" in lines
    assert "0.05 -> peak 0.15 at step 200 -> 0.15 | 0.5 -> peak 1.5 at step 200 -> 1.5 |" in lines
    noise = grid([0.0, 0.0])
    for s in (0, 1, 2):
        noise[(0.1, s)]["curves"]["val/loss"][0][1] += 0.01 * (-1) ** s
    assert "never resolved (every interval includes 0)" in "\n".join(
        over_training.markdown(noise, [1e-5, 0.1], 1e-5))
    assert over_training.markdown({(1e-5, 0): {"eps": 1e-5, "seed": 0}}, [1e-5], 1e-5) == []


def test_the_report_figures_over_training_draw_the_paired_gap_and_the_seeds_mean(tmp_path, monkeypatch):
    """report_figures' loss gap (mean over seeds of the paired difference at each validation,
    with its band) and its four panels of the first and the final norm's curves (the seeds'
    geometric mean), on the grid above."""
    import numpy as np

    from lnmonitor.experiments.eps import report_figures

    figures = []
    monkeypatch.setattr(report_figures, "save_png", lambda fig, path: figures.append(fig))
    records = grid([0.5, 0.2, 0.0])
    assert report_figures.figure_loss_gap(records, [1e-5, 0.1], 1e-5, tmp_path / "gap.png")
    (ax,) = figures.pop().axes
    (line,) = [ln for ln in ax.lines if ln.get_label().startswith("eps=0.1")]
    assert list(line.get_xdata()) == [100, 200, 300]
    np.testing.assert_allclose(line.get_ydata(), [0.501, 0.201, 0.001], rtol=1e-9)  # gap + 0.001 x mean seed
    assert len(ax.collections) == 1  # the 95% band
    assert report_figures.figure_training_curves(records, [1e-5, 0.1], tmp_path / "curves.png")
    panels = figures.pop().axes
    # seed s scales its curves by 2^(s - 2): the seeds' geometric mean is half the fixture's curve
    expected = {0: {1e-5: [5e-4, 2e-4, 1.5e-4], 0.1: [0.495, 0.45, 0.475]},
                3: {1e-5: [0.5, 1.0, 1.5], 0.1: [0.5, 1.0, 1.5]}}  # first norm's transmission, final's rms
    assert FIRST.rsplit(".", 1)[-1] in panels[0].get_title() and "lnf" in panels[3].get_title()
    for i, by_eps in expected.items():
        lines = {ln.get_label(): ln for ln in panels[i].lines}
        for eps, label in ((1e-5, "eps=1e-05"), (0.1, "eps=0.1")):
            assert list(lines[label].get_xdata()) == [0, 100, 200]
            np.testing.assert_allclose(lines[label].get_ydata(), by_eps[eps], rtol=1e-9, err_msg=(i, eps))
