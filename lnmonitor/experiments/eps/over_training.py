"""An eps comparison over training, from the curves in the run records: when the validation-loss gap
opens (:func:`loss_gap`, paired by seed), whether the first norm ever starts normalising, and how the stream
grows (:func:`curve_mean`); :func:`markdown` is the report's section."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lnmonitor.core.output.metric_names import VAL_LOSS, per_norm
from lnmonitor.experiments.eps.statistics import interval
from lnmonitor.experiments.eps.store import eps_label, record_final, record_rungs

__all__ = ["curve_mean", "first_below_half", "ladder_ends", "loss_gap", "markdown"]


def _curve(record: dict, tag: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in (record.get("curves") or {}).get(tag, []) if v is not None}


def loss_gap(records: dict, eps: float, base: float) -> list[dict]:
    """Per validation step logged by every pair: ``{"step", "seeds", **interval}`` of the validation loss at
    ``eps`` minus at ``base``, paired by seed."""
    seeds = sorted(s for (e, s) in records if e == eps and (base, s) in records)
    pairs = {s: (_curve(records[(eps, s)], VAL_LOSS), _curve(records[(base, s)], VAL_LOSS)) for s in seeds}
    steps = sorted(set.intersection(*(set(a) & set(b) for a, b in pairs.values()))) if pairs else []
    return [{"step": step, "seeds": seeds, **interval([a[step] - b[step] for a, b in pairs.values()])}
            for step in steps]


def curve_mean(runs: Sequence[dict], tag: str) -> tuple[list[int], list[float]]:
    """The geometric mean over ``runs`` of one training curve, on the steps all runs logged."""
    curves = [c for c in (_curve(r, tag) for r in runs) if c]
    if not curves:
        return [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    values = [float(np.exp(np.mean([np.log(max(c[s], 1e-300)) for c in curves]))) for s in steps]
    return steps, values


def first_below_half(record: dict, tag: str) -> int | None:
    """The first logged step at which the curve is below half its first logged value; None if never."""
    curve = sorted(_curve(record, tag).items())
    return next((s for s, v in curve if v < curve[0][1] / 2), None) if curve else None


def _resolved(gap: list[dict]) -> str:
    """When the gap's interval first excludes 0, and whether it stays so."""
    out = [g["step"] for g in gap if g["lo"] is not None and (g["lo"] > 0 or g["hi"] < 0)]
    if not out:
        return "never resolved (every interval includes 0)"
    stays = all(g["step"] in out for g in gap if g["step"] >= out[0])
    return f"first resolved at step {out[0]}" + (", and at every validation after it" if stays else
                                                 f", resolved at {len(out)} of {len(gap)} validations")


def _start_peak_end(steps: list[int], values: list[float], spec: str) -> str:
    if not values:
        return "-"
    peak = int(np.argmax(values))
    return (f"{values[0]:{spec}} -> peak {values[peak]:{spec}} at step {steps[peak]} -> "
            f"{values[-1]:{spec}}")


def _gap_table(gaps: dict[float, list[dict]]) -> list[str]:
    shown = [e for e, g in gaps.items() if g]
    lines = ["| step | " + " | ".join(f"eps={eps_label(e)}" for e in shown) + " |",
             "|---:|" + "---:|" * len(shown)]
    for step in sorted({g["step"] for e in shown for g in gaps[e]}):
        cells = []
        for e in shown:
            g = next((g for g in gaps[e] if g["step"] == step), None)
            span = "" if g is None or g["lo"] is None else f" ({g['lo']:+.4f} to {g['hi']:+.4f})"
            cells.append("" if g is None else f"{g['mean']:+.4f}{span}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines + [""] + [f"- eps={eps_label(e)} ({len(gaps[e][0]['seeds'])} paired seeds): "
                           f"{_resolved(gaps[e])}." for e in shown]


def _first_norm_row(eps: float, runs: list[dict], first: str, final: str) -> str | None:
    tag = per_norm("transmission", first)
    steps, t = curve_mean(runs, tag)
    if not t:
        return None
    least = int(np.argmin(t))
    halves = [(r["seed"], first_below_half(r, tag)) for r in runs]
    halves = ", ".join(f"{seed}: {'never' if step is None else step}" for seed, step in halves)
    rms = [_start_peak_end(*curve_mean(runs, per_norm("rms", n)), ".3g") for n in (first, final)]
    return (f"| {eps_label(eps)} | {t[0]:.3g} -> {t[least]:.3g} at step {steps[least]} -> {t[-1]:.3g} "
            f"| {halves} | {rms[0]} | {rms[1]} |")


def ladder_ends(record: dict) -> tuple[str, str]:
    """The first rung and the final norm of a run record (the last rung when it has none)."""
    rungs = record_rungs(record)
    return rungs[0], record_final(record) or rungs[-1]


def markdown(records: dict, eps_values: Sequence[float], base: float) -> list[str]:
    """The report's section over training (empty when no run has curves)."""
    by_eps = {e: [r for (x, _), r in sorted(records.items()) if x == e] for e in eps_values}
    ends = next((ladder_ends(r) for rs in by_eps.values() for r in rs if record_rungs(r)), None)
    if not ends or not any(r.get("curves") for rs in by_eps.values() for r in rs):
        return []
    first, final = ends
    lines = ["## Over training", "",
             f"From the curves in the run records. Transmission and rms: the monitors' logs on training "
             f"batches, geometric mean over seeds; first norm `{first}`, final norm `{final}`.", ""]
    gaps = {e: loss_gap(records, e, base) for e in eps_values if e != base}
    if any(gaps.values()):
        lines += [f"Validation loss minus eps={eps_label(base)}, paired by seed (mean, 95% interval):", ""]
        lines += _gap_table(gaps) + [""]
    lines += ["| eps | transmission, first norm: step 0 -> least -> end | first step below half its step-0 "
              "value, per seed | stream rms, first norm | stream rms, final norm |", "|---|---|---|---|---|"]
    rows = (_first_norm_row(e, runs, first, final) for e, runs in by_eps.items())
    return lines + [row for row in rows if row] + [""]
