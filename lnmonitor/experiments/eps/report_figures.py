"""The PNG figures of an eps comparison, drawn from the run records alone."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lnmonitor.core.output.metric_names import per_norm
from lnmonitor.experiments.eps.over_training import curve_mean, ladder_ends, loss_gap
from lnmonitor.experiments.eps.statistics import interval
from lnmonitor.experiments.eps.store import eps_label, norm_value, record_norms, record_rungs, share_baseline
from lnmonitor.experiments.plotting import scatter_sweep, sweep_legend
from lnmonitor.views.names import short_name, short_names
from lnmonitor.views.plotting import new_figure, save_png

__all__ = [
    "FIGURES", "figure_dose_response", "figure_invariance", "figure_ladder", "figure_loss_gap",
    "figure_shares", "figure_training_curves", "figure_transmission_by_norm", "figure_val_loss",
]

FIGURES = {
    "val_loss": "val_loss_curves.png", "loss_gap": "loss_gap_over_training.png",
    "dose_response": "dose_response.png", "training_curves": "transmission_and_rms_over_training.png",
    "transmission_by_norm": "transmission_by_norm.png", "ladder": "inv_sigma_ladder.png",
    "invariance": "invariance_vs_eps_over_var.png", "shares": "share_medians.png",
}


def _colors(eps_values: Sequence[float]) -> dict[float, str]:
    palette = ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink")
    return {e: palette[i % len(palette)] for i, e in enumerate(sorted(eps_values))}


def _runs(records: dict, eps: float) -> list[dict]:
    """The records at ``eps``, by seed."""
    return [r for (e, _), r in sorted(records.items()) if e == eps]


def _finish(fig, ax, path: Path, ylabel: str, title: str) -> bool:
    """Label, grid and legend ``ax``, write ``fig`` to ``path``; True (a figure was drawn)."""
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)
    return True


def figure_val_loss(curves: dict, eps_values: Sequence[float], path: Path) -> bool:
    if not any(curves.values()):
        return False
    colors = _colors(eps_values)
    fig = new_figure()
    ax = fig.add_subplot()
    labelled = set()
    for (eps, _), curve in sorted(curves.items()):
        if not curve:
            continue
        label = None if eps in labelled else f"eps={eps_label(eps)}"
        labelled.add(eps)
        ax.plot(*zip(*curve, strict=True), color=colors[eps], marker="o", markersize=3, linewidth=1.2,
                alpha=0.8, label=label)
    ax.set_xlabel("optimizer step")
    return _finish(fig, ax, path, "validation loss (nats/char)", "Validation loss, one line per seed")


def figure_loss_gap(records: dict, eps_values: Sequence[float], base: float, path: Path) -> bool:
    """Per eps, the validation loss minus at ``base`` by step, paired by seed: mean and 95% interval."""
    colors = _colors(eps_values)
    fig = new_figure()
    ax = fig.add_subplot()
    drawn = False
    for eps in eps_values:
        gap = loss_gap(records, eps, base) if eps != base else []
        if not gap:
            continue
        steps = [g["step"] for g in gap]
        ax.plot(steps, [g["mean"] for g in gap], "o-", color=colors[eps], markersize=3,
                label=f"eps={eps_label(eps)} ({len(gap[0]['seeds'])} seeds)")
        spans = [(s, g["lo"], g["hi"]) for s, g in zip(steps, gap, strict=True) if g["lo"] is not None]
        if spans:
            ax.fill_between(*zip(*spans, strict=True), color=colors[eps], alpha=0.2)
        drawn = True
    if not drawn:
        return False
    ax.axhline(0.0, color="0.4", linewidth=0.8, linestyle=":")
    ax.set_xlabel("optimizer step")
    return _finish(fig, ax, path, f"validation loss minus eps={eps_label(base)} (nats/char)",
                   "The loss gap over training, paired by seed (band: 95% interval)")


def _per_norm(records: dict, eps: float, field: str, rungs: bool = False) -> tuple[list[str], np.ndarray]:
    """Norm names (every norm, or the ladder's ``rungs``, in the first run's order) and a (runs, norms) array
    of one held-out statistic."""
    runs = [r for r in _runs(records, eps) if record_norms(r)]
    if not runs:
        return [], np.empty((0, 0))
    names = record_rungs(runs[0]) if rungs else record_norms(runs[0])
    rows = [[norm_value(r, n, field) for n in names] for r in runs]
    return names, np.asarray([[np.nan if v is None else v for v in row] for row in rows], dtype=float)


def figure_ladder(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    colors = _colors(eps_values)
    fig = new_figure()
    ax = fig.add_subplot()
    drawn = False
    for eps in eps_values:
        names, values = _per_norm(records, eps, "inv_sigma", rungs=True)
        if not names:
            continue
        x = np.arange(len(names))
        for i, row in enumerate(values):
            ax.plot(x, row, color=colors[eps], marker="o", alpha=0.8,
                    label=f"eps={eps_label(eps)}" if i == 0 else None)
        ax.set_xticks(x, short_names(names), rotation=45, ha="right")
        drawn = True
    if not drawn:
        return False
    ax.set_yscale("log")
    return _finish(fig, ax, path, "1/sigma of the norm's input (median row, log scale)",
                   "The 1/sigma ladder on held-out text, one line per seed")


def figure_invariance(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    """Left: each run's scale sweep, abs(delta loss) against eps/var of the final norm's input, each point
    marked by why it is in the fit or not, with the fitted line.  Right: per run, the scale-3 case's float64
    output residual and abs(delta loss) against the run's own eps/var."""
    colors = _colors(eps_values)
    fig = new_figure(11.0, 4.5)
    ax_sweep, ax_runs = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    reasons: set[str] = set()
    for eps in eps_values:
        runs = _runs(records, eps)
        for r in runs:
            slope, const = r["headline"].get("scale_slope"), r["headline"].get("scale_constant")
            fitted = slope is not None and _pos(const)
            sweep = [(p.get("eps_over_var"), p.get("dloss"), p.get("in_fit"), p.get("rounding"))
                     for p in (r.get("invariance") or {}).get("sweep") or []]
            sweep = [p for p in sweep if p[0] is not None and p[1] is not None]
            reasons |= scatter_sweep(ax_sweep, sweep, fitted, colors[eps])
            ends = [x for x, _, in_fit, _ in sweep if in_fit]
            if fitted and len(ends) >= 2:
                xs = np.geomspace(min(ends), max(ends), 20)
                ax_sweep.plot(xs, const * xs**slope, color=colors[eps], linewidth=1, alpha=0.8)
        xs = [r["headline"].get("final_eps_over_var") for r in runs]
        for key, marker, what in (("out_residual_scale_3", "s", "output residual"),
                                  ("dloss_scale_3", "^", "abs(delta loss)")):
            pts = [(x, r["headline"].get(key)) for x, r in zip(xs, runs, strict=True)]
            # abs: the delta-loss is signed (a run whose loss fell is drawn, not left out)
            pts = [(x, abs(y)) for x, y in pts if _pos(x) and y is not None and _pos(abs(y))]
            if pts:
                ax_runs.scatter(*zip(*pts, strict=True), color=colors[eps], marker=marker, s=30,
                                label=f"{what}, eps={eps_label(eps)}")
    if not reasons and not ax_runs.get_legend_handles_labels()[0]:
        return False
    for ax in (ax_sweep, ax_runs):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    sweep_legend(ax_sweep, reasons, {f"eps={eps_label(e)}": colors[e] for e in eps_values})
    if ax_runs.get_legend_handles_labels()[0]:
        ax_runs.legend(fontsize=8)
    ax_sweep.set_xlabel("eps/var of the scaled final-norm input (median row)")
    ax_sweep.set_ylabel("abs(delta loss), nats")
    ax_sweep.set_title("Scale sweep: each point marked by why it is in the fit or not", fontsize=10)
    ax_runs.set_xlabel("eps/var of the final norm's input (median row)")
    ax_runs.set_ylabel("error of the scale-3 case")
    ax_runs.set_title("Scale 3: float64 output residual and delta loss", fontsize=10)
    save_png(fig, path)
    return True


def _pos(value) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def figure_shares(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    colors = _colors(eps_values)
    fig = new_figure()
    ax = fig.add_subplot()
    baseline, names = None, []
    width = 0.8 / max(len(eps_values), 1)
    for i, eps in enumerate(eps_values):
        names_e, values = _per_norm(records, eps, "share_median")
        if not names_e:
            continue
        names = names_e
        x = np.arange(len(names)) + (i - (len(eps_values) - 1) / 2) * width
        cols = [interval(list(values[:, j])) for j in range(values.shape[1])]
        means = [c["mean"] if c["mean"] is not None else np.nan for c in cols]
        errs = [c["half_width"] if c["half_width"] is not None else 0.0 for c in cols]
        ax.bar(x, means, width=width, yerr=errs, color=colors[eps], alpha=0.8, capsize=2,
               label=f"eps={eps_label(eps)}")
        for r in (r for (e, _), r in records.items() if e == eps):
            baseline = baseline or (share_baseline(r) or {}).get("median")
    if not names:
        return False
    if baseline:
        ax.axhline(baseline, color="black", linestyle="--", linewidth=1,
                   label=f"random direction, median {baseline:.4f}")
    ax.set_xticks(np.arange(len(names)), short_names(names), rotation=45, ha="right")
    ax.set_ylabel("median dead-plane share on held-out text")
    ax.set_title("Dead-plane share per norm (bars: mean over seeds, 95% interval)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    save_png(fig, path)
    return True


def figure_dose_response(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    """Against eps (log), needing three: the validation loss per seed with its mean and 95% interval; the
    transmission at the first and final norm (geometric mean); the ladder's attenuation and growth."""
    runs = {e: _runs(records, e) for e in eps_values}
    eps = [e for e in sorted(eps_values) if runs[e]]
    if len(eps) < 3:
        return False
    fig = new_figure(12.0, 3.8)
    ax_loss, ax_t, ax_l = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    for e in eps:
        losses = [r["headline"]["val_loss"] for r in runs[e]]
        ax_loss.scatter([e] * len(losses), losses, color="0.6", s=12, zorder=2)
        cell = interval(losses)
        err = [[cell["mean"] - cell["lo"]], [cell["hi"] - cell["mean"]]] if cell["lo"] is not None else None
        ax_loss.errorbar([e], [cell["mean"]], yerr=err, fmt="o", color="tab:blue", capsize=3, zorder=3)
    for key, label, color in (("first_transmission", "first norm", "tab:orange"),
                              ("final_transmission", "final norm", "tab:green")):
        means = [interval([r["headline"].get(key) for r in runs[e]], log=True)["mean"] for e in eps]
        ax_t.plot(eps, means, "o-", color=color, label=label)
    ax_t.plot(eps, eps, ":", color="0.5", label="eps itself")
    for key, label in (("attenuation", "attenuation"), ("growth", "growth")):
        ax_l.plot(eps, [interval([r["headline"].get(key) for r in runs[e]])["mean"] for e in eps], "o-",
                  label=label)
    for ax in (ax_loss, ax_t, ax_l):
        ax.set_xscale("log")
        ax.set_xlabel("eps")
        ax.grid(alpha=0.3, which="both")
    ax_t.set_yscale("log")
    ax_loss.set_ylabel("validation loss (nats/char)")
    ax_loss.set_title("validation loss: seeds, mean, 95% interval", fontsize=9)
    ax_t.set_ylabel("transmission eps/(var+eps), median row")
    ax_t.set_title("how much each norm stops normalising", fontsize=9)
    ax_l.set_title("1/sigma ladder: attenuation; rms growth", fontsize=9)
    for ax in (ax_t, ax_l):
        ax.legend(fontsize=7)
    save_png(fig, path)
    return True


def figure_training_curves(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    """Over training, per eps (geometric mean over seeds): the transmission at the first and the final norm,
    and the rms of the stream they read."""
    runs = {e: _runs(records, e) for e in eps_values}
    ends = next((ladder_ends(r) for rs in runs.values() for r in rs if record_rungs(r)), None)
    if not ends or not any(r.get("curves") for rs in runs.values() for r in rs):
        return False
    colors = _colors(eps_values)
    fig = new_figure(11.0, 7.0)
    first, final = ends
    panels = [(per_norm("transmission", first), "transmission, first norm"),
              (per_norm("transmission", final), "transmission, final norm"),
              (per_norm("rms", first), "rms of the stream, first norm"),
              (per_norm("rms", final), "rms of the stream, final norm")]
    for i, (tag, title) in enumerate(panels, start=1):
        ax = fig.add_subplot(2, 2, i)
        for e in sorted(eps_values):
            steps, values = curve_mean(runs[e], tag)
            if steps:
                ax.plot(steps, values, color=colors[e], label=f"eps={eps_label(e)}")
        ax.set_yscale("log")
        ax.set_title(f"{title} ({short_name(tag.rsplit('/', 1)[-1], ends)})", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3, which="both")
        if i == 1:
            ax.legend(fontsize=7)
    save_png(fig, path)
    return True


def figure_transmission_by_norm(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    """For the largest eps with a finished run, every norm's transmission over training (geometric mean over
    seeds) as a heatmap: which norms stop normalising, when."""
    finished = [e for e in eps_values if any(x == e for x, _ in records)]
    if not finished:
        return False
    eps = max(finished)
    runs = _runs(records, eps)
    names = next((record_norms(r) for r in runs if record_norms(r)), None)
    if not names or not any(r.get("curves") for r in runs):
        return False
    rows, steps = [], None
    for name in names:
        s, v = curve_mean(runs, per_norm("transmission", name))
        if not s:
            return False
        steps = s if steps is None else steps
        rows.append(v[: len(steps)])
    grid = np.log10(np.maximum(np.asarray([r[: min(map(len, rows))] for r in rows]), 1e-12))
    fig = new_figure(9.0, 0.35 * len(names) + 1.8)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest",
                      extent=(steps[0], steps[grid.shape[1] - 1], len(names) - 0.5, -0.5))
    ax.set_yticks(range(len(names)), short_names(names), fontsize=7)
    ax.set_xlabel("optimizer step")
    ax.set_title(f"eps={eps_label(eps)}: log10 transmission eps/(var+eps) per norm over training", fontsize=9)
    fig.colorbar(image, ax=ax, label="log10 transmission")
    save_png(fig, path)
    return True
