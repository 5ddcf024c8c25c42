"""The report of an eps comparison: merge the run records, write ``results.json``, ``report.md`` and the
figures.  Works from the run records alone (they carry their training curves), so ``lnmonitor report``
rebuilds it without torch, Lightning, event files or training."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

from lnmonitor.core.output.files import atomic_write_json, atomic_write_text
from lnmonitor.core.output.metric_names import VAL_LOSS
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps import report_figures
from lnmonitor.experiments.eps.over_training import markdown as over_training
from lnmonitor.experiments.eps.report_figures import FIGURES
from lnmonitor.experiments.eps.statistics import aggregate, paired_difference
from lnmonitor.experiments.eps.store import (
    RESULTS_FORMAT,
    RESULTS_NAME,
    eps_label,
    grid_pairs,
    load_results,
    scan_records,
    share_baseline,
)

REPORT_NAME = "report.md"

# (key in a record's "headline", label, format). Keys absent from every record are left out.
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("val_loss", "validation loss (nats/char)", ".4f"),
    ("scale_slope", "scale sweep: slope of log abs(delta loss) on log(eps/var), runs with a fit", ".3f"),
    ("scale_constant", "scale sweep: constant, runs with a fit (geometric mean)", ".3g"),
    ("dloss_scale_3", "delta loss (signed), final-norm input scaled by 3", ".3g"),
    ("dloss_scale_0.01", "delta loss (signed), final-norm input scaled by 0.01", ".3g"),
    ("out_residual_scale_3", "final-norm output residual at scale 3, float64 (geometric mean)", ".3g"),
    ("final_eps_over_var", "final norm: eps/var, median row (geometric mean)", ".3g"),
    ("first_transmission", "first norm: transmission eps/(var+eps), median row (geometric mean)", ".3g"),
    ("final_transmission", "final norm: transmission eps/(var+eps), median row (geometric mean)", ".3g"),
    ("max_transmission", "largest median transmission over the norms (geometric mean)", ".3g"),
    ("attenuation", "1/sigma ladder: attenuation, first norm / last norm", ".3f"),
    ("growth", "residual rms growth, last norm / first norm", ".3f"),
    ("final_share_median", "final norm: median dead-plane share", ".4f"),
    ("mean_share_median", "median dead-plane share, averaged over the norms", ".4f"),
)


def merge_results(out: Path, config: dict, pairs: Sequence[tuple[float, int]]) -> dict:
    """The merged results of the grid ``pairs`` ((eps, seed), every invocation's so far) from the records
    now on disk."""
    on_disk = scan_records(out, config)
    pairs = [(float(e), int(s)) for e, s in pairs]
    records = {p: on_disk[p] for p in pairs if p in on_disk}
    eps_values = sorted({e for e, _ in pairs})
    seeds = sorted({s for _, s in pairs})
    base = min(eps_values)
    train = sum(r.get("train_seconds") or 0.0 for r in records.values())
    measure = sum(r.get("measure_seconds") or 0.0 for r in records.values())
    return {
        "format": RESULTS_FORMAT,
        "config": config,
        "grid": {"pairs": [[e, s] for e, s in pairs], "eps": eps_values, "seeds": seeds},
        "runs": [records[p] for p in pairs if p in records],
        "missing": [{"eps": e, "seed": s} for (e, s) in pairs if (e, s) not in records],
        "not_in_grid": [{"eps": e, "seed": s} for (e, s) in sorted(on_disk) if (e, s) not in set(pairs)],
        "baseline_eps": base,
        "aggregates": aggregate(records, eps_values),
        "differences": {eps_label(e): paired_difference(records, e, base) for e in eps_values if e != base},
        "seconds": {"train": train, "measure": measure, "total": train + measure,
                    "occupied": occupied_seconds(records.values())},
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def occupied_seconds(runs: Iterable[dict]) -> float:
    """The wall time ``runs`` occupied: the union of their spans, each ending at its record's ``finished``
    time and lasting its training and measurement time (runs side by side count once, gaps not at all)."""
    spans = []
    for r in runs:
        if r.get("finished"):
            end = datetime.strptime(r["finished"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
            spans.append((end - (r.get("train_seconds") or 0.0) - (r.get("measure_seconds") or 0.0), end))
    total, reach = 0.0, -float("inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def results_pairs(results: dict) -> list[tuple[float, int]]:
    """The (eps, seed) pairs of a results file's grid."""
    grid = results["grid"]
    if "pairs" in grid:
        return [(float(e), int(s)) for e, s in grid["pairs"]]
    return grid_pairs(grid["eps"], grid["seeds"])


def records_of(results: dict) -> dict:
    return {(float(r["eps"]), int(r["seed"])): r for r in results["runs"]}


def publish(out: Path, config: dict, pairs: Sequence[tuple[float, int]]) -> dict:
    """Rebuild ``results.json``, ``report.md`` and the figures from the records on disk, again until no
    record appeared meanwhile (so the last of several shards finishing at once merges every record)."""
    while True:
        results = merge_results(out, config, pairs)
        atomic_write_json(Path(out) / RESULTS_NAME, results)
        write_report(out, results)
        again = {p for p in scan_records(out, config) if p in set(results_pairs(results))}
        if again == set(records_of(results)):
            return results


def load_folder(out: Path) -> dict:
    """The merged results of an eps-compare ``--out`` folder; UsageError when it is none."""
    out = Path(out)
    if not out.is_dir():
        raise UsageError(f"{str(out)!r} is not a folder: pass the --out folder of an eps-compare run")
    results = load_results(out)
    if results is None:
        raise UsageError(f"{str(out / RESULTS_NAME)!r} does not exist: pass the --out folder of an "
                         "eps-compare run")
    return results


def rebuild(outs: Sequence[Path]) -> dict[str, dict]:
    """``lnmonitor report``: re-merge the records under each folder of ``outs`` and rewrite its report,
    every folder checked before anything is written.  Returns the merged results by folder."""
    names = [str(out) for out in outs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"{', '.join(map(repr, twice))} given twice: name each folder once")
    loaded = {name: load_folder(Path(name)) for name in names}
    return {name: publish(Path(name), r["config"], results_pairs(r)) for name, r in loaded.items()}


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _table(agg: dict) -> list[str]:
    lines = ["| figure | mean | 95% interval | seeds |", "|---|---:|---:|---:|"]
    for key, label, spec in HEADLINE:
        cell = agg["figures"].get(key)
        if cell is None or cell["n"] == 0:
            continue
        span = ("undefined (one seed)" if cell["half_width"] is None
                else f"{_fmt(cell['lo'], spec)} to {_fmt(cell['hi'], spec)}")
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
    lines = [
        "# eps comparison", "",
        f"Tiny GPT (width {recipe.get('width')}, depth {recipe.get('depth')}, heads {recipe.get('heads')}, "
        f"context {recipe.get('context')}, {recipe.get('norm')} norm, {recipe.get('init', 'default')} "
        f"initialisation), {recipe.get('max_steps')} steps of batch {recipe.get('batch_size')}, peak lr "
        f"{recipe.get('lr')}, weight decay {recipe.get('weight_decay')} on "
        f"{'every parameter' if recipe.get('decay', 'all') == 'all' else 'the matrices'}; data: {data_name} "
        f"({data.get('chars')} characters, sha256 {str(data.get('sha256'))[:12]}). "
        f"eps {', '.join(eps_label(e) for e in grid['eps'])}; seeds {', '.join(map(str, grid['seeds']))}. "
        "Intervals are Student-t 95% intervals across seeds, computed on the logarithms for the figures "
        "that are positive by nature (their geometric mean then); measurements are on the fixed "
        "held-out windows, the invariance on the probe rows.",
    ]
    lines += ["", f"Runs finished: {len(present)} of {len(present) + len(missing)}."]
    if missing:
        shown = ", ".join(f"eps={eps_label(m['eps'])} seed={m['seed']}" for m in missing)
        lines.append(f"**Missing** (not finished, or left to another shard): {shown}. "
                     "The figures below use only the finished runs.")
    if results.get("not_in_grid"):
        shown = ", ".join(f"eps={eps_label(m['eps'])} seed={m['seed']}" for m in results["not_in_grid"])
        lines.append(f"Also on disk but not in this grid (left out): {shown}.")

    lines += ["", "## Verdict", ""]
    diffs = results["differences"]
    if not diffs:
        lines.append("Only one eps in the grid: nothing to compare.")
    for diff in diffs.values():
        lines.append(f"- {diff['verdict']}")
    if len(diffs) > 1:
        lines.append("- Each interval covers one comparison; none is corrected for the several made here.")

    lines += ["", f"## Validation loss against eps={eps_label(base)} (paired by seed)", ""]
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
        lines += [f"Seeds: {', '.join(map(str, agg['seeds']))}.", ""] + _table(agg)
        notes = [((r.get("invariance") or {}).get("fit_note") or "") for r in present
                 if eps_label(r["eps"]) == label]
        fitted = sum(1 for n in notes if n.startswith("fitted"))
        unfit = sorted({n for n in notes if n.startswith("no fit")})
        lines += ["", f"Scale sweep fitted in {fitted} of {len(notes)} runs"
                  + (f"; otherwise {'; '.join(unfit)}." if unfit else "."), ""]

    baseline = next((share_baseline(r) for r in present if share_baseline(r)), None)
    if baseline:
        lines += [f"Random baseline for the dead-plane share (a uniformly random direction, "
                  f"d={baseline.get('d')}, k={baseline.get('k')}): median {baseline.get('median'):.4f}.", ""]

    lines += over_training(records_of(results), [float(e) for e in grid["eps"]], base)
    lines += ["## Figures", ""]
    captions = {
        "val_loss": "Validation loss during training, one line per seed",
        "loss_gap": "The validation-loss gap to the smallest eps over training, paired by seed, 95% interval",
        "dose_response": "Dose-response: validation loss, transmission and the ladder against eps",
        "training_curves": "Transmission and stream rms of the first and final norm over training",
        "transmission_by_norm": "Transmission of every norm over training, largest eps with a finished run",
        "ladder": "The 1/sigma ladder per eps",
        "invariance": "Scale sweep against eps/var (log-log), each point marked by why it is in the fit or "
                      "not, with the fitted lines; the scale-3 case per run",
        "shares": "Median dead-plane share per norm against the random baseline",
    }
    missing = {"dose_response": "needs finished runs at three or more eps values",
               "loss_gap": "needs a larger eps with validation curves paired by seed"}
    for key, name in FIGURES.items():
        lines += [f"![{captions[key]}]({name})" if figures.get(key)
                  else f"- {captions[key]}: {missing.get(key, 'no data yet')}.", ""]

    seconds = results["seconds"]
    lines += ["## Wall time", ""]
    if present:
        monitored = sum(1 for r in present if r.get("monitors"))
        threads = ", ".join(map(str, sorted({r["threads"] for r in present if r.get("threads")})))
        lines.append(
            f"Training {_minutes(seconds['train'])} summed over {len(present)} runs, measurement "
            f"{_minutes(seconds['measure'])}; the runs occupied {_minutes(seconds['occupied'])} of "
            "wall time (the union of their spans, each ending at its record's finish time and lasting its "
            "training and measurement time: runs trained side by side with `--jobs` count once, the gaps "
            "between invocations not at all). Each run counts its final attempt; time lost to an "
            f"interruption is not counted. Torch threads per run: {threads or 'not recorded'}. "
            f"Monitors attached in {monitored} of {len(present)} runs."
        )
    lines += ["", f"Rebuild with `lnmonitor report {out}`.", ""]
    return "\n".join(lines)


def write_report(out: Path, results: dict) -> Path:
    """Write ``report.md`` and the figures under ``out``; returns the report's path."""
    out = Path(out)
    records = records_of(results)
    eps_values = [float(e) for e in results["grid"]["eps"]]
    curves = {p: [tuple(point) for point in (r.get("curves") or {}).get(VAL_LOSS, [])]
              for p, r in records.items()}
    figures = {
        "val_loss": report_figures.figure_val_loss(curves, eps_values, out / FIGURES["val_loss"]),
        "loss_gap": report_figures.figure_loss_gap(records, eps_values, results["baseline_eps"],
                                                   out / FIGURES["loss_gap"]),
    }
    for key in ("dose_response", "training_curves", "transmission_by_norm", "ladder", "invariance", "shares"):
        figures[key] = getattr(report_figures, f"figure_{key}")(records, eps_values, out / FIGURES[key])
    for key, drawn in figures.items():
        if not drawn:  # no data (any more): no stale picture either
            (out / FIGURES[key]).unlink(missing_ok=True)
    atomic_write_text(out / REPORT_NAME, render_markdown(results, figures, out))
    return out / REPORT_NAME
