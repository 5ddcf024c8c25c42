"""The PNG figures of an :class:`~lnmonitor.experiments.analysis.Analysis`: a norm's Jacobian spectrum, the
share distributions against the random density, the 1/sigma ladder and the scale sweep."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lnmonitor.core.maths import geometry, random_baseline
from lnmonitor.experiments.analysis import Analysis
from lnmonitor.experiments.plotting import scatter_sweep, sweep_legend
from lnmonitor.views.plotting import new_figure, save_png

__all__ = ["write_figures"]


def _fig_spectrum(a: Analysis, path: Path) -> None:
    # the final norm's (the meter's rule); the last norm probed when the model has none
    n = next((x for x in a.norms if x.name == a.result.figures.final), a.norms[-1])
    k = geometry.dead_dim(n.kind)
    floor = 1e-20
    idx = np.arange(1, n.width + 1)
    plain = np.full(n.width, n.inv_sigma)
    plain[n.width - k] = n.transmission * n.inv_sigma
    if k == 2:
        plain[-1] = 0.0
    fig = new_figure(7, 4.2)
    ax = fig.add_subplot()
    ax.semilogy(idx, np.maximum(n.singular_values, floor), ".", label=f"with the learned gain, eps={n.eps:g}")
    ax.semilogy(idx, np.maximum(n.singular_values_eps0, floor), "x", ms=4, label="with the gain, eps=0")
    ax.semilogy(idx, np.maximum(plain, floor), "-", lw=1, color="gray",
                label="without gain: 1/sigma (closed form)")
    ax.set_xlabel("index (descending)")
    ax.set_ylabel("singular value")
    ax.set_title(f"{a.short(n.name)}: Jacobian spectrum at one row (gain spread {n.gain_spread:.2f}x)")
    ax.legend(fontsize=8)
    save_png(fig, path)


def _fig_shares(a: Analysis, path: Path) -> None:
    measured = [(f, s) for f, s in a.per_norm() if f.stats.share_rows]
    cols = min(3, len(measured))
    rows = math.ceil(len(measured) / cols)
    fig = new_figure(3.4 * cols, 2.6 * rows)
    for i, (f, s) in enumerate(measured):
        ax = fig.add_subplot(rows, cols, i + 1)
        edges = s.layout.share_edges()
        top = min(1.0, max(0.5, f.stats.share_max) * 1.05)
        # the meter's share histogram (its bins), as a density
        ax.stairs(s.share_counts / (s.share_counts.sum() * np.diff(edges)), edges, fill=True, alpha=0.6,
                  label="observed")
        ax.set_xlim(0, top)
        if f.width is not None:
            grid = np.linspace(0, top, 300)
            ax.plot(grid, random_baseline.share_pdf(grid, f.width, geometry.dead_dim(f.kind)), "k-", lw=1,
                    label="random direction")
        ax.axvline(a.result.figures.baseline(f.name)[1], color="k", ls=":", lw=1,
                   label="random max, same rows")
        ax.axvline(f.stats.share_max, color="C3", lw=1, label="observed max")
        ax.set_title(a.short(f.name), fontsize=9)
        ax.set_ylabel("density", fontsize=7)
        ax.tick_params(labelsize=7)
        if i == 0:
            ax.legend(fontsize=6)
    fig.suptitle("dead-plane share of w = g * dL/dy against the random baseline", fontsize=10)
    save_png(fig, path)


def _fig_ladder(a: Analysis, path: Path) -> None:
    rungs, figures = a.rungs, a.result.figures
    x = np.arange(len(rungs))
    fig = new_figure(7.5, 4.2)
    ax = fig.add_subplot()
    ax.plot(x, [r.rms for r in rungs], "o-", label="rms of the stream")
    ax.plot(x, [r.inv_sigma for r in rungs], "s-", label="1/sigma of the norm reading it")
    ax.set_xticks(x, [a.short(r.name) for r in rungs], rotation=35, ha="right", fontsize=7)
    ax.set_xlabel("rung: the norm reading the stream, in forward order")
    ax.set_ylabel("rms, 1/sigma (log scale)")
    ax.set_yscale("log")
    ax.set_title(f"the 1/sigma ladder: attenuation {figures.attenuation:.2f}x, growth {figures.growth:.2f}x")
    ax.legend(fontsize=8)
    save_png(fig, path)


def _fig_sweep(a: Analysis, path: Path) -> None:
    inv = a.invariance
    fitted = math.isfinite(inv.slope)
    fig = new_figure(6.5, 4.2)
    ax = fig.add_subplot()
    points = [(p.eps_over_var, p.dloss, p.in_fit, p.rounding) for p in inv.sweep]
    reasons = scatter_sweep(ax, points, fitted, "C0")
    lines = {}
    if fitted:
        xs = np.logspace(-5, 1, 50)
        ax.plot(xs, inv.constant * xs**inv.slope, "k-", lw=1)
        lines[f"|dloss| = {inv.constant:.3g} (eps/v)^{inv.slope:.2f}"] = "black"
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("eps / v at the final norm (after scaling by a)")
    ax.set_ylabel("|delta loss|, nats")
    ax.set_title(f"scale sweep of {a.short(inv.final_norm)}")
    sweep_legend(ax, reasons, lines)
    save_png(fig, path)


def write_figures(a: Analysis, folder: Path, stem: str = "analysis") -> dict[str, str]:
    """Write the PNG figures into ``folder``; returns figure name -> file name."""
    made = {}
    shares = any(f.stats.share_rows and s.share_counts is not None for f, s in a.per_norm())
    plots = {"spectrum": (_fig_spectrum, bool(a.norms)), "shares": (_fig_shares, shares),
             "ladder": (_fig_ladder, bool(a.rungs)), "sweep": (_fig_sweep, a.invariance is not None)}
    for name, (fn, possible) in plots.items():
        if possible:
            fname = f"{stem}_{name}.png"
            fn(a, folder / fname)
            made[name] = fname
    return made
