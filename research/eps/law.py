"""One law across eps comparisons: every run's paired loss difference against one predictor
the monitors log, fitted across the grids (and so across initialisations).

Each run at an eps other than its grid's smallest is one point: its validation loss minus
that of the smallest eps at the same seed (the pairing of
:func:`lnmonitor.experiments.eps.statistics.paired_difference`), against how far the first
norm stops normalising, its ``eps/var`` (median row).  The transmission ``eps/(var+eps)``
is ``r/(1+r)`` of ``r = eps/var``: it ranks the runs alike, but saturates at 1 where
eps/var still spans decades.  Three predictors (:data:`PREDICTORS`): at step 0 (the
monitor's first measured training batch, before any update), its geometric mean over
training (the monitor's curve), and at the end (the held-out measurement).

Per predictor: Spearman's rank correlation with its p-value, and a hinge
``difference = slope * max(0, log10(p / knee))`` fitted by least squares (the knee from the
smallest predictor to a decade below the largest), with 95% percentile intervals from a
bootstrap that resamples seeds within each grid: the differences of one seed share their
baseline run, so the seed is the unit that varies.

Everything here works from the merged results of :mod:`lnmonitor.experiments.eps.report`, without
torch; scipy is imported only when the law is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lnmonitor.core.output.files import atomic_write_json, atomic_write_text
from lnmonitor.core.output.metric_names import per_norm
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps.store import eps_label, norm_value, record_rungs

__all__ = [
    "LAW_FIGURE", "PREDICTORS", "LawPoint", "eps_over_var_at_end", "eps_over_var_at_init",
    "eps_over_var_over_training", "figure_law", "fit_hinge", "law", "law_points", "render_law", "sentence",
    "write_law",
]

LAW_FIGURE = "law.png"
RESAMPLES = 2000
KNEES = 400  # knees tried, evenly in log10 of the predictor
SPAN = 1.0  # the knee lies at least this many decades below the largest predictor


def _first(record: dict) -> str | None:
    """The ladder's first rung (the first norm reading the residual stream)."""
    rungs = record_rungs(record)
    return rungs[0] if rungs else None


def _curve(record: dict) -> list[tuple[int, float]]:
    first = _first(record)
    points = (record.get("curves") or {}).get(per_norm("eps_over_var", first), [])
    return [(int(s), float(v)) for s, v in points if v is not None and math.isfinite(v) and v > 0]


def eps_over_var_at_init(record: dict) -> float | None:
    """The first norm's eps/var at step 0 (the monitor's curve); None when step 0 was not logged."""
    return next((v for s, v in _curve(record) if s == 0), None)


def eps_over_var_over_training(record: dict) -> float | None:
    """The geometric mean of the first norm's eps/var curve over every logged step."""
    values = [v for _, v in _curve(record)]
    return float(np.exp(np.mean(np.log(values)))) if values else None


def eps_over_var_at_end(record: dict) -> float | None:
    """The first norm's eps/var on the held-out text after training (median row)."""
    value = norm_value(record, _first(record), "eps_over_var")
    return value if value is not None and math.isfinite(value) and value > 0 else None


# name -> (what it is, in words; how to read it from a run record)
PREDICTORS: dict[str, tuple[str, Callable[[dict], float | None]]] = {
    "init": ("first norm's eps/var at step 0 (monitor)", eps_over_var_at_init),
    "mean": ("first norm's eps/var, geometric mean over training (monitor)", eps_over_var_over_training),
    "end": ("first norm's eps/var at the end (held-out text)", eps_over_var_at_end),
}


@dataclass(frozen=True)
class LawPoint:
    """One run against its grid's smallest eps at the same seed."""

    grid: str
    init: str
    eps: float
    seed: int
    difference: float  # nats/char: this run's validation loss minus the baseline's
    predictors: dict[str, float | None]


def law_points(grids: dict[str, dict]) -> list[LawPoint]:
    """The points of every grid (``name -> merged results``, as ``results.json``)."""
    points = []
    for name, results in grids.items():
        records = {(float(r["eps"]), int(r["seed"])): r for r in results["runs"]}
        init = (results["config"].get("recipe") or {}).get("init", "default")
        for diff in results["differences"].values():
            for seed, d in zip(diff["seeds"], diff["differences"], strict=True):
                record = records[(float(diff["eps"]), int(seed))]
                points.append(LawPoint(
                    grid=name, init=init, eps=float(diff["eps"]), seed=int(seed), difference=float(d),
                    predictors={key: read(record) for key, (_, read) in PREDICTORS.items()},
                ))
    return points


def fit_hinge(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float] | None:
    """``(knee, slope, sse)`` of the least-squares ``y = slope * max(0, x - knee)``, the knee
    searched on a grid from ``min(x)`` to :data:`SPAN` below ``max(x)`` (so the slope is
    carried over at least that span, not by the scatter of points at one dose); None when
    ``x`` spans less than that."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.max() - x.min() < SPAN:
        return None
    knees = np.linspace(x.min(), x.max() - SPAN, KNEES)
    z = np.maximum(0.0, x[None, :] - knees[:, None])  # (knees, points)
    slope = (z @ y) / (z * z).sum(axis=1)
    sse = ((y[None, :] - slope[:, None] * z) ** 2).sum(axis=1)
    k = int(np.argmin(sse))
    return float(knees[k]), float(slope[k]), float(sse[k])


def _percentiles(values) -> list[float] | None:
    values = np.asarray(values, dtype=float)
    return [float(v) for v in np.percentile(values, [2.5, 97.5])] if values.size else None


def _fit(points: Sequence[LawPoint], key: str, resamples: int, seed: int) -> dict:
    """Spearman's rho, the hinge and its bootstrap intervals for one predictor."""
    from scipy import stats  # here: the command line's one-line errors do not load scipy

    used = [p for p in points if p.predictors.get(key)]
    out: dict = {"predictor": key, "label": PREDICTORS[key][0], "n": len(used)}
    if len(used) < 3:
        return out
    x = np.log10([p.predictors[key] for p in used])
    y = np.asarray([p.difference for p in used])
    rho, p_value = stats.spearmanr(x, y)
    out.update(spearman=float(rho), spearman_p=float(p_value))
    hinge = fit_hinge(x, y)
    if hinge is None:
        return out
    knee, slope, sse = hinge
    grid = np.linspace(x.min(), x.max(), 60)
    units: dict[str, dict[int, list[int]]] = {}  # grid -> seed -> indices of its points
    for i, p in enumerate(used):
        units.setdefault(p.grid, {}).setdefault(p.seed, []).append(i)
    rng = np.random.default_rng(seed)
    knees, slopes, curves = [], [], []
    for _ in range(resamples):
        idx = [i for seeds in units.values()
               for s in rng.choice(list(seeds), size=len(seeds)) for i in seeds[int(s)]]
        refit = fit_hinge(x[idx], y[idx])
        if refit is not None:
            knees.append(refit[0])
            slopes.append(refit[1])
            curves.append(refit[1] * np.maximum(0.0, grid - refit[0]))
    band = np.percentile(np.asarray(curves), [2.5, 97.5], axis=0) if curves else None
    knee_span = _percentiles(knees)
    residual_sd = math.sqrt(sse / (len(used) - 2))
    # the doses the slope rests on: those whose fitted cost stands above the scatter
    carrying = sorted({(p.grid, p.eps) for p, xi in zip(used, x, strict=True)
                       if abs(slope) * max(0.0, xi - knee) > residual_sd})
    out.update(
        knee=10**knee, slope_per_decade=slope,
        doses_carrying_slope=[f"{g} eps={eps_label(e)}" for g, e in carrying],
        knee_at={x.min(): "smallest", x.max() - SPAN: "largest"}.get(knee),
        residual_sd=residual_sd,
        knee_interval=None if knee_span is None else [10**v for v in knee_span],
        slope_interval=_percentiles(slopes), refits=len(slopes),
        curve={"predictor": [10**v for v in grid], "fit": list(slope * np.maximum(0.0, grid - knee)),
               "lo": None if band is None else list(band[0]), "hi": None if band is None else list(band[1])},
    )
    return out


def law(grids: dict[str, dict], resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """The law across ``grids`` (``name -> merged results``): the points, and per predictor
    Spearman's rho and the hinge with its bootstrap intervals; ``best`` names the predictor
    whose hinge leaves the smallest residual sd."""
    if resamples < 1:
        raise UsageError(f"resamples must be a positive integer, got {resamples!r}")
    points = law_points(grids)
    if len(points) < 3:
        raise UsageError(
            f"the law needs at least 3 paired loss differences (runs at an eps above their grid's "
            f"smallest, with the smallest at the same seed); {', '.join(grids)} hold {len(points)}"
        )
    fits = {key: _fit(points, key, resamples, seed) for key in PREDICTORS}
    ranked = [k for k in fits if fits[k].get("residual_sd") is not None]
    return {
        "grids": {name: {"init": (r["config"].get("recipe") or {}).get("init", "default"),
                         "baseline_eps": r["baseline_eps"]} for name, r in grids.items()},
        "points": [vars(p) for p in points],
        "fits": fits,
        "resamples": resamples,
        "best": min(ranked, key=lambda k: fits[k]["residual_sd"]) if ranked else None,
    }


# ---------------------------------------------------------------------------
# law.md, law.json and the figure
# ---------------------------------------------------------------------------


def _span(pair, spec: str) -> str:
    return "-" if pair is None else f"{format(pair[0], spec)} to {format(pair[1], spec)}"


def _where(fit: dict) -> str:
    knee = fit["knee"]
    if fit["knee_at"] == "smallest":
        return "from the smallest value measured on (no harmless range resolved below it)"
    if fit["knee_at"] == "largest":
        return (f"when the {fit['label']} exceeds {knee:.3g}, the largest knee the fit allows ({SPAN:g} "
                "decade below the largest value: only the largest values carry the cost, so the data do "
                "not locate the knee)")
    return (f"when the {fit['label']} exceeds {knee:.3g} (transmission {knee / (1 + knee):.2f}; 95% "
            f"interval of the knee {_span(fit['knee_interval'], '.3g')})")


def sentence(fit: dict) -> str:
    """The fit of one predictor in the words a practitioner can use, claiming no more than
    its intervals."""
    if fit.get("slope_per_decade") is None:
        return f"{fit['label']}: too few points ({fit['n']}) for a fit."
    slope = fit["slope_per_decade"]
    lo, hi = fit["slope_interval"]
    if lo <= 0 <= hi:
        return (f"No cost resolved: the fitted slope above the knee is {slope:+.4f} nats/char per decade of "
                f"eps/var, 95% interval {lo:+.4f} to {hi:+.4f}, which includes 0.")
    verb = "costs" if slope > 0 else "saves"
    said = (f"A large eps {verb} loss {_where(fit)}: about {abs(slope):.4f} nats/char per decade of eps/var "
            f"above it (95% interval {lo:+.4f} to {hi:+.4f}).")
    if len(fit["doses_carrying_slope"]) == 1:
        said += (f" One dose carries the slope ({fit['doses_carrying_slope'][0]}: the only one whose fitted "
                 "cost exceeds the residual sd), so the slope is that dose's cost spread over its distance "
                 "from the knee, not a rate measured across doses.")
    return said


def _fit_row(fit: dict) -> str:
    rho = f"{fit['spearman']:+.2f} ({fit['spearman_p']:.2g})" if "spearman" in fit else "-"
    if fit.get("slope_per_decade") is None:
        return f"| {fit['label']} | {fit['n']} | {rho} | - | - | - |"
    knee = f"{fit['knee']:.3g} ({_span(fit['knee_interval'], '.3g')})"
    slope = f"{fit['slope_per_decade']:+.4f} ({_span(fit['slope_interval'], '+.4f')})"
    return f"| {fit['label']} | {fit['n']} | {rho} | {knee} | {slope} | {fit['residual_sd']:.4f} |"


def render_law(result: dict, figure: bool) -> str:
    """``law.md``: the grids, the fit of every predictor, the best one in words, the points."""
    lines = ["# One law across the eps comparisons", "",
             "Each point is one run: its validation loss minus that of its grid's smallest eps at the same "
             "seed (nats/char), against a predictor the monitors log. Spearman's rho ranks the points; the "
             "hinge `difference = slope * max(0, log10(p / knee))` is fitted by least squares; intervals "
             f"are 95% percentiles of {result['resamples']} bootstrap refits resampling seeds within each "
             "grid (a seed's points share their baseline run).", "",
             "| grid | initialisation | baseline eps | points |", "|---|---|---:|---:|"]
    for name, grid in result["grids"].items():
        n = sum(1 for p in result["points"] if p["grid"] == name)
        lines.append(f"| {name} | {grid['init']} | {eps_label(grid['baseline_eps'])} | {n} |")
    lines += ["", "## Which predictor", "",
              "| predictor | points | Spearman rho (p) | knee (95% interval) | slope, nats/char per decade "
              "(95% interval) | residual sd |", "|---|---:|---:|---:|---:|---:|"]
    lines += [_fit_row(fit) for fit in result["fits"].values()]
    best = result["best"]
    lines.append("")
    if best is None:
        lines.append("No predictor has a fit: no single predictor works on these points.")
    else:
        lines.append(f"Best (smallest residual sd): the {result['fits'][best]['label']}. "
                     + sentence(result["fits"][best]))
    labels = " | ".join(label for label, _ in PREDICTORS.values())
    lines += ["", "## Points", "", f"| grid | eps | seed | difference | {labels} |",
              "|---|---:|---:|---:|" + "---:|" * len(PREDICTORS)]
    for p in result["points"]:
        values = [p["predictors"][k] for k in PREDICTORS]
        cells = " | ".join("-" if v is None else f"{v:.3g}" for v in values)
        lines.append(f"| {p['grid']} | {eps_label(p['eps'])} | {p['seed']} | {p['difference']:+.4f} | "
                     f"{cells} |")
    if figure:
        lines += ["", "![The paired loss difference against each predictor, with the hinge and its band]"
                      f"({LAW_FIGURE})"]
    return "\n".join(lines) + "\n"


def figure_law(result: dict, path: Path) -> bool:
    """One panel per predictor: the points (marker: grid, colour: eps) against the predictor
    (log), the hinge and its 95% bootstrap band."""
    from lnmonitor.views.plotting import new_figure, save_png

    fits = [f for f in result["fits"].values() if f["n"]]
    if not fits:
        return False
    grids = list(result["grids"])
    eps_values = sorted({p["eps"] for p in result["points"]})
    cmap = {e: f"C{i}" for i, e in enumerate(eps_values)}
    markers = dict(zip(grids, "os^Dv<>", strict=False))
    fig = new_figure(4.2 * len(fits), 4.2)
    for i, fit in enumerate(fits, start=1):
        ax = fig.add_subplot(1, len(fits), i)
        for p in result["points"]:
            x = p["predictors"][fit["predictor"]]
            if x:
                ax.scatter(x, p["difference"], color=cmap[p["eps"]], marker=markers[p["grid"]], s=22,
                           label=f"{p['grid']}, eps={eps_label(p['eps'])}")
        curve = fit.get("curve")
        if curve:
            ax.plot(curve["predictor"], curve["fit"], color="black", linewidth=1.2, label="hinge fit")
            if curve["lo"] is not None:
                ax.fill_between(curve["predictor"], curve["lo"], curve["hi"], color="0.5", alpha=0.25,
                                label="95% bootstrap band")
        ax.axhline(0.0, color="0.4", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel(fit["label"], fontsize=8)
        rho = f"Spearman {fit['spearman']:+.2f}" if "spearman" in fit else "too few points"
        ax.set_title(f"{fit['predictor']}: {rho}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        if i == 1:
            ax.set_ylabel("validation loss minus the baseline eps, same seed (nats/char)", fontsize=8)
            handles, labels = ax.get_legend_handles_labels()
            unique = dict(zip(labels, handles, strict=True))
            ax.legend(unique.values(), unique.keys(), fontsize=6)
    save_png(fig, path)
    return True


def write_law(out: Path, grids: dict[str, dict], resamples: int = RESAMPLES) -> dict:
    """Write ``law.json``, ``law.md`` and the figure under ``out``; returns the law."""
    out = Path(out)
    result = law(grids, resamples)
    drawn = figure_law(result, out / LAW_FIGURE)
    atomic_write_json(out / "law.json", result)
    atomic_write_text(out / "law.md", render_law(result, drawn))
    return result
