"""Aggregate an eps comparison: intervals across seeds, report.md and PNG figures.

Everything here works from the run records (``results.json`` or the per-run
``result.json`` files) and the TensorBoard event files alone, so ``lnmonitor report``
rebuilds the report without torch, Lightning or any training.

Intervals are Student-t 95% intervals across seeds, ``mean +/- t(0.975, n-1) s / sqrt(n)``;
with one seed the interval is undefined and the report says so rather than inventing
one. The loss difference between an eps and the smallest eps is paired by seed (the same
seed gives the same initialisation and batch stream) and uses the paired t interval.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import stats

from lnmonitor.errors import UsageError
from lnmonitor.experiments.store import (
    RESULTS_FORMAT,
    RESULTS_NAME,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    eps_label,
    grid_pairs,
    load_results,
    run_dir,
    scan_records,
)

REPORT_NAME = "report.md"
CONFIDENCE = 0.95

# (key in a record's "headline", label, format). Keys absent from every record are left out.
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("val_loss", "validation loss (nats/char)", ".4f"),
    ("scale_slope", "scale sweep: slope of log abs(delta loss) on log(eps/var)", ".3f"),
    ("scale_constant", "scale sweep: constant", ".3g"),
    ("dloss_scale_3", "abs(delta loss), final-norm input scaled by 3", ".3g"),
    ("dloss_scale_0.01", "abs(delta loss), final-norm input scaled by 0.01", ".3g"),
    ("out_residual_scale_3", "final-norm output residual at scale 3 (float64)", ".3g"),
    ("final_eps_over_var", "final norm: eps/var (median row)", ".3g"),
    ("final_transmission", "final norm: transmission eps/(var+eps) (median row)", ".3g"),
    ("max_transmission", "largest median transmission over the norms", ".3g"),
    ("attenuation", "1/sigma ladder: attenuation, first norm / last norm", ".3f"),
    ("growth", "residual rms growth, last norm / first norm", ".3f"),
    ("final_share_median", "final norm: median dead-plane share", ".4f"),
    ("mean_share_median", "median dead-plane share, averaged over the norms", ".4f"),
)

FIGURES = {
    "val_loss": "val_loss_curves.png",
    "ladder": "inv_sigma_ladder.png",
    "invariance": "invariance_vs_eps_over_var.png",
    "shares": "share_medians.png",
}


# ---------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------


def interval(values: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """Mean and two-sided Student-t interval of ``values`` (non-finite values are dropped).

    ``half_width``, ``lo``, ``hi`` and ``sd`` are None when fewer than two values remain:
    one seed says nothing about the spread across seeds.
    """
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    n = int(x.size)
    out = {"n": n, "mean": None, "sd": None, "half_width": None, "lo": None, "hi": None}
    if n == 0:
        return out
    mean = float(x.mean())
    out["mean"] = mean
    if n >= 2:
        sd = float(x.std(ddof=1))
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
        out.update(sd=sd, half_width=half, lo=mean - half, hi=mean + half)
    return out


def paired_difference(records: dict, eps: float, base: float, key: str = "val_loss") -> dict:
    """``headline[key]`` at ``eps`` minus at ``base``, paired by seed, with its t interval."""
    seeds = sorted(s for (e, s) in records if e == eps and (base, s) in records)
    diffs, used = [], []
    for seed in seeds:
        a = records[(eps, seed)]["headline"].get(key)
        b = records[(base, seed)]["headline"].get(key)
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            diffs.append(a - b)
            used.append(seed)
    result = interval(diffs)
    result.update(eps=eps, baseline_eps=base, seeds=used, differences=diffs)
    base_mean = interval([records[(base, s)]["headline"].get(key) for s in used])["mean"]
    result["relative"] = (result["mean"] / base_mean) if result["mean"] is not None and base_mean else None
    result["verdict"] = verdict(result)
    return result


def verdict(diff: dict) -> str:
    """Plain words for a paired loss difference that claim no more than its interval allows."""
    e, b, n, d, h = (
        eps_label(diff["eps"]), eps_label(diff["baseline_eps"]), diff["n"], diff["mean"], diff["half_width"]
    )
    if n == 0:
        return f"eps={e}: no seed has finished at both eps={e} and eps={b} yet: nothing to compare."
    if h is None:
        return (
            f"eps={e} minus eps={b}: {d:+.4f} nats/char from a single seed. A 95% interval needs at "
            "least two seeds, so no difference is resolved at this number of seeds."
        )
    pct = f", {abs(diff['relative']) * 100:.1f}% of the eps={b} loss" if diff.get("relative") else ""
    span = f"95% interval {diff['lo']:+.4f} to {diff['hi']:+.4f}, {n} paired seeds"
    if diff["lo"] > 0:
        return f"eps={e} is worse than eps={b} by {d:.4f} +/- {h:.4f} nats/char{pct} ({span})."
    if diff["hi"] < 0:
        return f"eps={e} is better than eps={b} by {-d:.4f} +/- {h:.4f} nats/char{pct} ({span})."
    return (
        f"No difference resolved at this number of seeds: eps={e} minus eps={b} is "
        f"{d:+.4f} +/- {h:.4f} nats/char ({span}; the interval includes 0)."
    )


def aggregate(records: dict, eps_values: Sequence[float]) -> dict:
    """Per eps, the interval of every headline figure across the seeds present."""
    out = {}
    for eps in eps_values:
        runs = [r for (e, _), r in sorted(records.items()) if e == eps]
        keys = sorted({k for r in runs for k in r.get("headline", {})})
        out[eps_label(eps)] = {
            "eps": eps,
            "seeds": [r["seed"] for r in runs],
            "figures": {k: interval([r["headline"].get(k) for r in runs]) for k in keys},
        }
    return out


# ---------------------------------------------------------------------------
# merging the run records
# ---------------------------------------------------------------------------


def merge_results(out: Path, config: dict, eps_values: Sequence[float], seeds: Sequence[int]) -> dict:
    """The merged results of the grid ``eps_values x seeds`` from the records now on disk."""
    on_disk = scan_records(out, config)
    pairs = grid_pairs(eps_values, seeds)
    records = {p: on_disk[p] for p in pairs if p in on_disk}
    eps_values = [float(e) for e in eps_values]
    base = min(eps_values)
    train = sum(r.get("train_seconds") or 0.0 for r in records.values())
    measure = sum(r.get("measure_seconds") or 0.0 for r in records.values())
    return {
        "format": RESULTS_FORMAT,
        "config": config,
        "grid": {"eps": eps_values, "seeds": [int(s) for s in seeds]},
        "runs": [records[p] for p in pairs if p in records],
        "missing": [{"eps": e, "seed": s} for (e, s) in pairs if (e, s) not in records],
        "not_in_grid": [{"eps": e, "seed": s} for (e, s) in sorted(on_disk) if (e, s) not in set(pairs)],
        "baseline_eps": base,
        "aggregates": aggregate(records, eps_values),
        "differences": {
            eps_label(e): paired_difference(records, e, base) for e in eps_values if e != base
        },
        "seconds": {"train": train, "measure": measure, "total": train + measure},
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def records_of(results: dict) -> dict:
    return {(float(r["eps"]), int(r["seed"])): r for r in results["runs"]}


def publish(out: Path, config: dict, eps_values: Sequence[float], seeds: Sequence[int]) -> dict:
    """Rebuild ``results.json``, ``report.md`` and the figures from the records on disk.

    Repeats until no record appeared meanwhile, so when several shards finish at once the
    last one to write has merged every record (each shard publishes after its own writes).
    """
    while True:
        results = merge_results(out, config, eps_values, seeds)
        atomic_write_json(Path(out) / RESULTS_NAME, results)
        write_report(out, results)
        again = {p for p in scan_records(out, config) if p in set(grid_pairs(eps_values, seeds))}
        if again == set(records_of(results)):
            return results


def rebuild(out: Path) -> dict:
    """``lnmonitor report``: re-merge the records under ``out`` and rewrite the report (no training)."""
    out = Path(out)
    if not out.is_dir():
        raise UsageError(f"{str(out)!r} is not a folder: pass the --out folder of an eps-compare run")
    results = load_results(out)
    if results is None:
        raise UsageError(
            f"{str(out / RESULTS_NAME)!r} does not exist: pass the --out folder of an eps-compare run"
        )
    return publish(out, results["config"], results["grid"]["eps"], results["grid"]["seeds"])


# ---------------------------------------------------------------------------
# event files
# ---------------------------------------------------------------------------


def read_scalar_curve(folder: Path, tag: str = "val/loss") -> list[tuple[int, float]]:
    """``(step, value)`` of one scalar from the event files in ``folder``, one value per step.

    A resumed run writes a second event file that repeats the steps after its checkpoint;
    the later value of a step wins. Empty when the folder or the tag is absent.
    """
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.glob("events.out.tfevents.*")):
        return []
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    by_step: dict[int, tuple[float, float]] = {}
    for event in acc.Scalars(tag):
        if event.step not in by_step or event.wall_time >= by_step[event.step][0]:
            by_step[event.step] = (event.wall_time, event.value)
    return [(step, value) for step, (_, value) in sorted(by_step.items())]


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------


def _figure(width: float = 7.0, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


def _colors(eps_values: Sequence[float]) -> dict[float, str]:
    palette = ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink")
    return {e: palette[i % len(palette)] for i, e in enumerate(sorted(eps_values))}


def _short(name: str) -> str:
    return name.removeprefix("model.").replace("blocks.", "")


def figure_val_loss(curves: dict, eps_values: Sequence[float], path: Path) -> bool:
    if not any(curves.values()):
        return False
    colors = _colors(eps_values)
    fig = _figure()
    ax = fig.add_subplot()
    labelled = set()
    for (eps, _), curve in sorted(curves.items()):
        if not curve:
            continue
        steps, values = zip(*curve, strict=True)
        label = None if eps in labelled else f"eps={eps_label(eps)}"
        labelled.add(eps)
        ax.plot(steps, values, color=colors[eps], marker="o", markersize=3, linewidth=1.2, alpha=0.8,
                label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title("Validation loss, one line per seed")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
    return True


def _per_norm(records: dict, eps: float, field: str) -> tuple[list[str], np.ndarray]:
    """Norm names (order of the first run) and a (runs, norms) array of one per-norm field."""
    runs = [r for (e, _), r in sorted(records.items()) if e == eps and r.get("norms")]
    if not runs:
        return [], np.empty((0, 0))
    names = list(runs[0].get("norm_order") or runs[0]["norms"])
    rows = [[(r["norms"].get(n) or {}).get(field, np.nan) for n in names] for r in runs]
    return names, np.asarray([[np.nan if v is None else v for v in row] for row in rows], dtype=float)


def figure_ladder(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    colors = _colors(eps_values)
    fig = _figure()
    ax = fig.add_subplot()
    drawn = False
    for eps in eps_values:
        names, values = _per_norm(records, eps, "inv_sigma")
        if not names:
            continue
        x = np.arange(len(names))
        for i, row in enumerate(values):
            ax.plot(x, row, color=colors[eps], marker="o", alpha=0.8,
                    label=f"eps={eps_label(eps)}" if i == 0 else None)
        ax.set_xticks(x, [_short(n) for n in names], rotation=45, ha="right")
        drawn = True
    if not drawn:
        return False
    ax.set_yscale("log")
    ax.set_ylabel("1/sigma of the norm's input (median row, log scale)")
    ax.set_title("The 1/sigma ladder on held-out text, one line per seed")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)
    return True


def figure_invariance(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    """Left: each run's scale sweep, abs(delta loss) against eps/var of the final norm's input,
    with its fitted line ``constant * (eps/var)^slope``; filled points are in the fit,
    hollow ones outside its range (crosses: float32 rounding, not eps). Right: one point per
    run, the float64 output residual and abs(delta loss) of the scale-3 case against the
    run's own eps/var, so the eps values line up along one law."""
    colors = _colors(eps_values)
    fig = _figure(11.0, 4.5)
    ax_sweep, ax_runs = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    drawn = False
    for eps in eps_values:
        runs = [r for (e, _), r in sorted(records.items()) if e == eps]
        label = f"eps={eps_label(eps)}"
        for r in runs:
            sweep = (r.get("invariance") or {}).get("sweep") or []
            pts = [p for p in sweep if _pos(p.get("eps_over_var")) and _pos(_abs(p.get("dloss")))]
            groups = (
                ([p for p in pts if p.get("in_fit")], colors[eps], "o"),
                ([p for p in pts if not p.get("in_fit") and not p.get("rounding")], "none", "o"),
                ([p for p in pts if p.get("rounding")], colors[eps], "x"),
            )
            for group, face, marker in groups:
                if not group:
                    continue
                kw = {"color": colors[eps]}
                if marker == "o":
                    kw = {"facecolors": face, "edgecolors": colors[eps]}
                ax_sweep.scatter([p["eps_over_var"] for p in group], [abs(p["dloss"]) for p in group],
                                 marker=marker, s=22, label=label, **kw)
                label, drawn = None, True
            fit = groups[0][0]
            slope = r["headline"].get("scale_slope")
            const = r["headline"].get("scale_constant")
            if len(fit) >= 2 and slope is not None and _pos(const):
                ends = [p["eps_over_var"] for p in fit]
                xs = np.geomspace(min(ends), max(ends), 20)
                ax_sweep.plot(xs, const * xs**slope, color=colors[eps], linewidth=1, alpha=0.8)
        xs = [r["headline"].get("final_eps_over_var") for r in runs]
        for key, marker, what in (("out_residual_scale_3", "s", "output residual"),
                                  ("dloss_scale_3", "^", "abs(delta loss)")):
            pts = [(x, r["headline"].get(key)) for x, r in zip(xs, runs, strict=True)]
            pts = [(x, y) for x, y in pts if _pos(x) and _pos(y)]
            if pts:
                ax_runs.scatter(*zip(*pts, strict=True), color=colors[eps], marker=marker, s=30,
                                label=f"{what}, eps={eps_label(eps)}")
                drawn = True
    if not drawn:
        return False
    for ax in (ax_sweep, ax_runs):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_sweep.set_xlabel("eps/var of the scaled final-norm input (median row)")
    ax_sweep.set_ylabel("abs(delta loss), nats")
    ax_sweep.set_title("Scale sweep (filled: fitted; x: float32 rounding)", fontsize=10)
    ax_runs.set_xlabel("eps/var of the final norm's input (median row)")
    ax_runs.set_ylabel("error of the scale-3 case")
    ax_runs.set_title("Scale 3: float64 output residual and delta loss", fontsize=10)
    _save(fig, path)
    return True


def _abs(value):
    return None if value is None else abs(value)


def _pos(value) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def figure_shares(records: dict, eps_values: Sequence[float], path: Path) -> bool:
    colors = _colors(eps_values)
    fig = _figure()
    ax = fig.add_subplot()
    drawn, baseline, names = False, None, []
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
            baseline = baseline or (r.get("share_baseline") or {}).get("median")
        drawn = True
    if not drawn:
        return False
    if baseline:
        ax.axhline(baseline, color="black", linestyle="--", linewidth=1,
                   label=f"random direction, median {baseline:.4f}")
    ax.set_xticks(np.arange(len(names)), [_short(n) for n in names], rotation=45, ha="right")
    ax.set_ylabel("median dead-plane share on held-out text")
    ax.set_title("Dead-plane share per norm (bars: mean over seeds, 95% interval)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    _save(fig, path)
    return True


# ---------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _table(agg: dict) -> list[str]:
    lines = [
        "| figure | mean | 95% interval | seeds |",
        "|---|---:|---:|---:|",
    ]
    for key, label, spec in HEADLINE:
        cell = agg["figures"].get(key)
        if cell is None or cell["n"] == 0:
            continue
        if cell["half_width"] is None:
            span = "undefined (one seed)"
        else:
            span = f"{_fmt(cell['lo'], spec)} to {_fmt(cell['hi'], spec)}"
        lines.append(f"| {label} | {_fmt(cell['mean'], spec)} | {span} | {cell['n']} |")
    return lines


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def render_markdown(results: dict, figures: dict[str, bool], out: Path) -> str:
    config, grid = results["config"], results["grid"]
    recipe = config.get("recipe", {})
    base = results["baseline_eps"]
    present, missing = results["runs"], results["missing"]
    data = config.get("data", {})
    data_name = next((r["data_name"] for r in present if r.get("data_name")), "the training text")
    lines = ["# eps comparison", ""]
    lines.append(
        f"Tiny GPT (width {recipe.get('width')}, depth {recipe.get('depth')}, heads {recipe.get('heads')}, "
        f"context {recipe.get('context')}, {recipe.get('norm')} norm), {recipe.get('max_steps')} steps of "
        f"batch {recipe.get('batch_size')}, peak lr {recipe.get('lr')}; data: {data_name} "
        f"({data.get('chars')} characters, sha256 {str(data.get('sha256'))[:12]}). "
        f"eps {', '.join(eps_label(e) for e in grid['eps'])}; seeds {', '.join(map(str, grid['seeds']))}. "
        "Intervals are Student-t 95% intervals across seeds; measurements are on the fixed held-out windows."
    )
    lines.append("")
    lines.append(f"Runs finished: {len(present)} of {len(present) + len(missing)}.")
    if missing:
        shown = ", ".join(f"eps={eps_label(m['eps'])} seed={m['seed']}" for m in missing)
        lines.append(f"**Missing** (not finished, or left to another shard): {shown}. "
                     "The figures below use only the finished runs.")
    if results.get("not_in_grid"):
        shown = ", ".join(f"eps={eps_label(m['eps'])} seed={m['seed']}" for m in results["not_in_grid"])
        lines.append(f"Also on disk but not in this grid (left out): {shown}.")
    lines.append("")

    lines += ["## Verdict", ""]
    diffs = results["differences"]
    if not diffs:
        lines.append("Only one eps in the grid: nothing to compare.")
    for diff in diffs.values():
        lines.append(f"- {diff['verdict']}")
    if len(diffs) > 1:
        lines.append("- Each interval covers one comparison; none is corrected for the several made here.")
    lines.append("")

    lines += [f"## Validation loss against eps={eps_label(base)} (paired by seed)", ""]
    if diffs:
        lines += ["| eps | mean difference (nats/char) | 95% interval | paired seeds | per seed |",
                  "|---|---:|---:|---:|---|"]
        for diff in diffs.values():
            span = ("undefined (one seed)" if diff["half_width"] is None
                    else f"{diff['lo']:+.4f} to {diff['hi']:+.4f}")
            pairs = zip(diff["seeds"], diff["differences"], strict=True)
            per_seed = ", ".join(f"{s}: {d:+.4f}" for s, d in pairs)
            lines.append(f"| {eps_label(diff['eps'])} | {_fmt(diff['mean'], '+.4f')} | {span} | "
                         f"{diff['n']} | {per_seed} |")
        lines.append("")

    for label, agg in results["aggregates"].items():
        lines += [f"## eps = {label}", ""]
        if not agg["seeds"]:
            lines += ["No finished run yet.", ""]
            continue
        lines.append(f"Seeds: {', '.join(map(str, agg['seeds']))}.")
        lines.append("")
        lines += _table(agg)
        lines.append("")

    baseline = next((r.get("share_baseline") for r in present if r.get("share_baseline")), None)
    if baseline:
        lines.append(
            f"Random baseline for the dead-plane share (a uniformly random direction, d={baseline.get('d')}, "
            f"k={baseline.get('k')}): median {baseline.get('median'):.4f}."
        )
        lines.append("")

    lines += ["## Figures", ""]
    captions = {
        "val_loss": "Validation loss during training, one line per seed",
        "ladder": "The 1/sigma ladder per eps",
        "invariance": "Invariance error against eps/var (log-log) with the fitted lines",
        "shares": "Median dead-plane share per norm against the random baseline",
    }
    for key, name in FIGURES.items():
        if figures.get(key):
            lines.append(f"![{captions[key]}]({name})")
        else:
            lines.append(f"- {captions[key]}: no data yet.")
        lines.append("")

    seconds = results["seconds"]
    lines += ["## Wall time", ""]
    if present:
        monitored = sum(1 for r in present if r.get("monitors"))
        lines.append(
            f"Training {_minutes(seconds['train'])}, measurement {_minutes(seconds['measure'])}, "
            f"total {_minutes(seconds['total'])} over {len(present)} runs (the final attempt of each run; "
            f"time lost to an interruption is not counted). Monitors attached in {monitored} of "
            f"{len(present)} runs."
        )
    lines += ["", f"Rebuild with `lnmonitor report {out}`.", ""]
    return "\n".join(lines)


def write_report(out: Path, results: dict) -> Path:
    """Write ``report.md`` and the figures under ``out``; returns the report's path."""
    out = Path(out)
    records = records_of(results)
    eps_values = [float(e) for e in results["grid"]["eps"]]
    curves = {p: read_scalar_curve(run_dir(out, *p)) for p in records}
    figures = {
        "val_loss": figure_val_loss(curves, eps_values, out / FIGURES["val_loss"]),
        "ladder": figure_ladder(records, eps_values, out / FIGURES["ladder"]),
        "invariance": figure_invariance(records, eps_values, out / FIGURES["invariance"]),
        "shares": figure_shares(records, eps_values, out / FIGURES["shares"]),
    }
    for key, drawn in figures.items():
        if not drawn:  # no data (any more): no stale picture either
            (out / FIGURES[key]).unlink(missing_ok=True)
    path = out / REPORT_NAME
    atomic_write_text(path, render_markdown(results, figures, out))
    return path
