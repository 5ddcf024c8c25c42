"""A one-screen summary of what lnmonitor logged for one run, from its curves ``{tag: [(step, value), ...]}``
(read back from a log, or kept by a monitor during the fit: ``lnmonitor summarize`` and the end-of-fit
summary print the same)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from lnmonitor.core.findings.reader import KINDS, TALL_AT_START, long_form
from lnmonitor.core.output.metric_names import (
    INVARIANCE_CASES,
    INVARIANCE_CONTROLS,
    VAL_LOSS,
    baseline_metric,
    health_metric,
    invariance_metric,
    ladder_metric,
    parse,
    per_norm,
)
from lnmonitor.views.names import NAME_WIDTH, name_prefix, short_names

__all__ = [
    "Curves", "RunCurves", "comparison_lines", "health_lines", "invariance_lines", "invariance_summary",
    "ladder_grid", "ladder_lines", "ladder_of", "last", "settings_lines", "summary_text",
]

Curves = Mapping[str, Sequence[tuple[int, float]]]


def last(curves: Curves, tag: str) -> float:
    points = curves.get(tag) or ()
    return float(points[-1][1]) if points else math.nan


class RunCurves:
    """What a monitor keeps of its curves for its end-of-fit views, in a size that does not grow with the
    fit: the first and last point of every tag, and the series of the tags starting with one of ``series``
    thinned to at most ``max_points`` steps (when full, every other kept step is dropped and the stride
    doubled; the last point is always there)."""

    def __init__(self, series: Sequence[str] = (), max_points: int = 256) -> None:
        self.series, self.max_points = tuple(series), max_points
        self._ends: dict[str, list[tuple[int, float]]] = {}
        self._points: dict[str, dict[int, float]] = {}
        self._kept: list[int] = []
        self._stride, self._count = 1, 0

    def add(self, step: int, metrics: Mapping[str, float]) -> None:
        for tag, value in metrics.items():
            self._ends.setdefault(tag, [(step, value)])[1:] = [(step, value)]
        if self._count % self._stride == 0:
            self._kept.append(step)
            for tag, value in metrics.items():
                if tag.startswith(self.series):
                    self._points.setdefault(tag, {})[step] = value
            if len(self._kept) > self.max_points:
                self._stride *= 2
                self._kept = self._kept[::2]
                keep = set(self._kept)
                for points in self._points.values():
                    for s in [s for s in points if s not in keep]:
                        del points[s]
        self._count += 1

    def curves(self) -> dict[str, list[tuple[int, float]]]:
        """``{tag: [(step, value), ...]}`` in step order."""
        out = {}
        for tag, ends in self._ends.items():
            points = dict(self._points.get(tag, {}))
            points.update(dict(ends))
            out[tag] = sorted(points.items())
        return out

    def __bool__(self) -> bool:
        return bool(self._ends)


def _first(curves: Curves, tag: str) -> tuple[int, float] | None:
    points = curves.get(tag) or ()
    return (int(points[0][0]), float(points[0][1])) if points else None


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def ladder_of(curves: Curves) -> tuple[list[str], list[str]]:
    """``(rungs in forward order, other norms)``, by the last ``ladder_position`` logged; without any,
    every norm is taken for a rung, in natural name order."""
    norms = sorted({m.name for m in map(parse, curves) if m and m[:2] == ("norm", "inv_sigma")}, key=_natural)
    position = {n: last(curves, per_norm("ladder_position", n)) for n in norms}
    if all(math.isnan(p) for p in position.values()):
        return norms, []
    rungs = sorted((n for n in norms if position[n] >= 0), key=lambda n: position[n])
    return rungs, [n for n in norms if not position[n] >= 0]


def ladder_grid(curves: Curves) -> tuple[list[str], list[int], np.ndarray]:
    """``(rungs, steps, values)``: 1/sigma as a rungs x steps array (NaN: no point at a step)."""
    rungs, _ = ladder_of(curves)
    series = [dict(curves.get(per_norm("inv_sigma", name), ())) for name in rungs]
    steps = sorted({s for points in series for s in points})
    grid = np.array([[points.get(s, np.nan) for s in steps] for points in series], dtype=float)
    return rungs, steps, grid.reshape(len(rungs), len(steps))


def _f(value: float, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    if abs(value) < 10 ** -(digits - 1) or abs(value) >= 1e4:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}" if abs(value) >= 1 else f"{value:.{digits}f}"


def summary_text(curves: Curves, title: str = "", watched: Sequence[str] | None = None,
                 start: tuple[int, float] | None = None, settings: Mapping[str, object] | None = None) -> str:
    """The ladder at the last logged step, how it moved, the invariance residuals and the findings; says
    so when nothing of lnmonitor was logged.  ``watched``: the finding kinds the run judged; ``start``:
    the ``(step, growth)`` they judged the growth from; ``settings``: the monitor's settings that differ
    from the defaults (each None: not known)."""
    if not any(points for tag, points in curves.items() if parse(tag)):
        return f"{title}: no lnmonitor metric logged" if title else "no lnmonitor metric logged"
    return "\n".join([f"lnmonitor summary{': ' + title if title else ''}", *settings_lines(settings),
                      *ladder_lines(curves, start), *invariance_lines(curves),
                      *health_lines(curves, watched)])


def invariance_summary(final_norm: str | None, step: int, metrics: Mapping[str, float],
                       settings: Mapping[str, object] | None = None) -> str:
    """The summary of one probe run (``metrics`` of ``step``): its residuals per case."""
    point = {tag: [(step, value)] for tag, value in metrics.items() if math.isfinite(value)}
    return "\n".join([f"lnmonitor summary: final norm {final_norm!r}", *settings_lines(settings),
                      *invariance_lines(point)])


def settings_lines(settings: Mapping[str, object] | None) -> list[str]:
    """The header's line of the settings that differ from the defaults (none when not known)."""
    if settings is None:
        return []
    changed = ", ".join(f"{name}={_setting(value)}" for name, value in settings.items())
    return [f"settings: {changed or 'the defaults'} (lnmonitor.Settings)"]


def _setting(value: object) -> str:
    """A function by its name, anything else as ``repr``."""
    return getattr(value, "__qualname__", None) or repr(value) if callable(value) else repr(value)


def health_lines(curves: Curves, watched: Sequence[str] | None = None) -> list[str]:
    """The run's findings (docs/findings.md): the step each was raised at and whether it still held at
    its last logged step; ``findings: none`` with what was ``watched`` when none was raised."""
    kinds = sorted(m.statistic for t, m in zip(curves, map(parse, curves), strict=True)
                   if m and m.group == "health" and curves[t])
    if not kinds and watched is not None:
        return [f"findings: none ({'watched: ' + ', '.join(watched) if watched else 'findings were off'})"]
    lines = ["findings (docs/findings.md):"] if kinds else []
    for kind in kinds:
        points = curves[health_metric(kind)]
        raised = next((s for s, v in points if v >= 1), points[0][0])
        held = "still held" if points[-1][1] >= 1 else "had ended"
        lines.append(f"  {kind}: raised at step {raised}; {held} at step {points[-1][0]}")
        if kind in KINDS:
            lines.append(f"    what it meant in the testbed: {long_form(kind)}")
    return lines


def ladder_lines(curves: Curves, fit_start: tuple[int, float] | None = None) -> list[str]:
    """The ladder and the shares at the last logged step, and how the ladder moved since ``fit_start``
    (None: the first logged growth)."""
    rungs, others = ladder_of(curves)
    if not rungs and not others:
        return []
    base_med = last(curves, baseline_metric("median"))
    base_max = last(curves, baseline_metric("max"))
    steps = sorted({s for n in rungs + others for s, _ in curves.get(per_norm("inv_sigma", n), ())})
    prefix = name_prefix(rungs + others)
    shared = f"; names without {prefix!r}" if prefix else ""
    lines = [f"  the ladder at step {steps[-1]} ({len(steps)} measured steps, the first at {steps[0]}"
             f"{shared}):",
             f"  {'norm':{NAME_WIDTH}s} {'1/sigma':>8s} {'rms':>8s} {'eps/var':>9s} {'share med':>9s} "
             f"{'share max':>9s}"]
    for name, short in zip(rungs + others, short_names(rungs + others), strict=True):
        med = last(curves, per_norm("share_median", name))
        row_base = last(curves, baseline_metric("median", name))
        mark = "" if name in rungs else "  (not a rung)"
        lines.append(
            f"  {short:{NAME_WIDTH}s} {_f(last(curves, per_norm('inv_sigma', name))):>8s} "
            f"{_f(last(curves, per_norm('rms', name))):>8s} "
            f"{_f(last(curves, per_norm('eps_over_var', name)), 2):>9s} "
            f"{_f(med):>9s} {_f(last(curves, per_norm('share_max', name))):>9s}{mark}"
            + (f"  random {_f(row_base)}" if math.isfinite(row_base) else "")
        )
    if math.isfinite(base_med):
        lines.append(f"  random direction: median share {_f(base_med)}, "
                     f"max of as many rows {_f(base_max)}")
    # an encoder-decoder's other stack (its encoder) has its own ladder: lnmonitor/ladder/<stack>/...
    others = sorted({m.name for m in map(parse, curves)
                     if m and m.group == "ladder" and m.statistic == "attenuation" and m.name})
    for stack in ("", *others):
        for key, word in (("attenuation", "1/sigma of the first rung / the last"),
                          ("growth", "rms of the last rung / the first")):
            tag = ladder_metric(key, stack)
            first, now = _first(curves, tag), last(curves, tag)
            label = f"{key} of {stack}'s ladder" if stack else (
                f"{key} of the model's ladder" if others else key)
            if first is not None:
                lines.append(f"  {label} ({word}): {_f(now)}x" + (
                    f", {_f(first[1])}x at step {first[0]}" if first[0] != steps[-1] else ""))
            if key == "growth" and not stack and (fit_start or first) is not None:
                step, growth = fit_start or first
                if growth > TALL_AT_START:
                    lines.append(f"  the ladder was already {_f(growth)}x at the fit's first step ({step}, "
                                 "before any update): a fact of the model the fit started from, not a "
                                 "finding (stream_growth judges the growth from there)")
    return lines


def invariance_lines(curves: Curves) -> list[str]:
    """The final-norm invariance residuals at the last probed point, one column per case."""
    cases = [c for c in INVARIANCE_CASES if math.isfinite(last(curves, invariance_metric("dloss", c)))]
    if not cases:
        return []
    names = [f"{c} (control)" if c in INVARIANCE_CONTROLS else c for c in cases]
    width = max(len(n) for n in names) + 1
    step = (curves.get(invariance_metric("dloss", cases[0])) or [(None,)])[-1][0]
    lines = [f"  {f'final-norm invariance at step {step}':33s}" + "".join(f"{n:>{width}s}" for n in names)]
    for statistic, label in (("dloss", "delta-loss (nats)"), ("out_residual", "float64 output residual")):
        values = "".join(f"{_f(last(curves, invariance_metric(statistic, c)), 2):>{width}s}" for c in cases)
        lines.append(f"    {label:31s}{values}")
    slope = last(curves, invariance_metric("scale_slope"))
    if math.isfinite(slope):
        lines.append(f"    scale sweep: |dloss| = {_f(last(curves, invariance_metric('scale_constant')))} "
                     f"nats x (eps/var)^{_f(slope)}")
    return lines


def comparison_lines(runs: Mapping[str, Curves]) -> list[str]:
    """Runs side by side, one row each, at their last logged step: the ladder, the final norm's figures,
    the scale_3 delta-loss and the validation loss."""
    header = ("run", "last step", "atten.", "growth", "final 1/sig", "final eps/var", "final share",
              "random", "scale_3 dL", "val loss")
    rows = [header]
    for name, curves in runs.items():
        rungs, _ = ladder_of(curves)
        final = rungs[-1] if rungs else ""
        steps = [s for t, pts in curves.items() if parse(t) for s, _ in pts]
        base = last(curves, baseline_metric("median", final))
        loss = next((last(curves, t) for t in (VAL_LOSS, "val_loss", "validation/loss") if t in curves),
                    math.nan)
        rows.append((
            name, str(max(steps)) if steps else "-",
            _f(last(curves, ladder_metric("attenuation"))), _f(last(curves, ladder_metric("growth"))),
            _f(last(curves, per_norm("inv_sigma", final))),
            _f(last(curves, per_norm("eps_over_var", final)), 2),
            _f(last(curves, per_norm("share_median", final))),
            _f(base if math.isfinite(base) else last(curves, baseline_metric("median"))),
            _f(last(curves, invariance_metric("dloss", "scale_3")), 2), _f(loss, 4),
        ))
    widths = [max(len(row[k]) for row in rows) for k in range(len(header))]
    return ["  " + f"{row[0]:{widths[0]}s}" + "".join(f"  {c:>{w}s}" for c, w in zip(row[1:], widths[1:],
                                                                                   strict=True))
            for row in rows]
