"""``analysis.md``, ``analysis.json`` and the terminal tables of an :class:`Analysis`, the model's figures
next to the study's (docs/design.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from lnmonitor.core.maths import geometry
from lnmonitor.core.output.files import finite
from lnmonitor.errors import UsageError
from lnmonitor.experiments.analysis import REFERENCE, STUDY_NOTE, Analysis
from lnmonitor.experiments.analysis_figures import write_figures

__all__ = ["headline_rows", "to_json", "to_markdown", "to_terminal", "write_outputs"]


def _f(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return str(int(value))
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0.0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 10 ** -(digits):
        return f"{value:.{max(digits - 1, 1)}e}"
    return f"{value:.{digits}f}"


def _range(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return _f(lo) if lo == hi else f"{_f(lo)} .. {_f(hi)}"


RTOLS = (1e-12, 1e-9, 1e-6, 1e-3)


def float32_rtol(width: int) -> float:
    """``torch.linalg.matrix_rank``'s default tolerance for a square float32 matrix, relative to its largest
    singular value: ``width * 2^-23``."""
    return width * 2.0**-23


def _rank_at(singular_values, rtol: float) -> int:
    """Numerical rank of a stored spectrum at a tolerance relative to its largest value."""
    sv = np.asarray(singular_values, dtype=float)
    return int((sv > rtol * sv.max()).sum()) if sv.size else 0


def _shares(a: Analysis) -> list[str]:
    """The headline's share rows: the meter's medians and maxima against its baselines."""
    figures = a.result.figures
    shares = [f for f, _ in a.per_norm() if f.stats.share_rows]
    above = sum(1 for f in shares if f.stats.share_max > figures.baseline(f.name)[1])
    final = figures.by_name().get(figures.final) if figures.final else None
    return [
        ("median share, per norm",
         f"{_range(f.stats.share_median for f in shares)} "
         f"(random {_range(figures.baseline(f.name)[0] for f in shares)})",
         REFERENCE["share_median"] + " (random 0.105)"),
        ("norms whose max share beats random max", f"{above} of {len(shares)}", REFERENCE["share_max_above"]),
        ("final norm max share",
         f"{_f(final.stats.share_max)} (random max {_f(figures.baseline(final.name)[1])})" if final else "-",
         REFERENCE["final_share_max"]),
    ]


def headline_rows(a: Analysis) -> list[tuple[str, str, str]]:
    """``(quantity, this model, study)`` rows; this model's figures are the meter's (what a monitor logs)
    except those marked the study's."""
    width = int(a.config.get("width", 0))
    vocab = len(a.config.get("vocab", ""))
    rows = [("validation loss, nats/char", f"{a.val_loss:.3f} ({vocab} symbols)", REFERENCE["val_loss"])]
    rows += _shares(a)
    if a.blocks:
        ranks = sorted({b.block_rank for b in a.blocks})
        loose = _range(_rank_at(b.branch_singular_values, 1e-6) for b in a.blocks)
        first = a.blocks[0]
        rows += [
            ("block rank at one position", f"{'/'.join(map(str, ranks))}/{width}", REFERENCE["block_rank"]),
            ("block singular values, all blocks pooled",
             f"{_f(min(b.block_sv_min for b in a.blocks))} .. {_f(max(b.block_sv_max for b in a.blocks))}",
             "(one block: next row)"),
            (f"block singular values, {a.short(first.name)} alone",
             f"{_f(first.block_sv_min)} .. {_f(first.block_sv_max)}", REFERENCE["block_sv"]),
            (f"branch rank ({first.branch})",
             f"{_range(b.branch_rank for b in a.blocks)} ({loose} at rtol 1e-6)", REFERENCE["branch_rank"]),
            (f"branch rank, {a.short(first.name)}, sv > {width} x 2^-23 s_max (torch's float32 default)",
             str(_rank_at(first.branch_singular_values, float32_rtol(width))), REFERENCE["branch_rank"]),
        ]
    rungs, figures = a.rungs, a.result.figures
    if rungs:
        first, last = rungs[0], rungs[-1]
        rows += [
            ("residual rms, first -> last rung (ours: median row; growth)",
             f"{_f(first.rms, 2)} -> {_f(last.rms, 2)} ({figures.growth:.1f}x)",
             "(another statistic: below)"),
            ("1/sigma, first -> last rung (ours: median row's sqrt(v + eps); attenuation)",
             f"{_f(first.inv_sigma)} -> {_f(last.inv_sigma)} ({figures.attenuation:.1f}x)",
             "(another statistic: below)"),
        ]
    if a.study:
        first, last, n = a.study[0], a.study[-1], a.study_sequences
        rows += [
            (f"residual rms, first -> last (study's: global rms, {n} sequences)",
             f"{_f(first.rms, 2)} -> {_f(last.rms, 2)} ({last.rms / first.rms:.1f}x)", REFERENCE["rms"]),
            (f"1/sigma, first -> last (study's: median unbiased row std, {n} sequences)",
             f"{_f(1 / first.std)} -> {_f(1 / last.std)} ({last.std / first.std:.1f}x)",
             REFERENCE["inv_sigma"]),
        ]
    inv = a.invariance
    if inv is not None:
        shift, scale = inv.cases.get("shift_5"), inv.cases.get("scale_3")
        rows += [
            ("dloss: shift 5 / scale 3",
             f"{_f(shift.dloss) if shift else '-'} / {_f(scale.dloss) if scale else '-'} "
             f"(float32 ulp of the loss {_f(float(np.spacing(np.float32(inv.base_loss))), 2)})",
             REFERENCE["shift_scale"]),
            ("scale error vs eps/v: slope / constant", f"{_f(inv.slope, 2)} / {_f(inv.constant)}",
             REFERENCE["slope"]),
        ]
    if a.norms:
        rows += [
            ("gain spread, max over norms", f"{_f(max(n.gain_spread for n in a.norms), 2)}x",
             REFERENCE["gain_spread"]),
            ("Jacobian vs autograd, max abs error",
             f"{_f(max(n.max_abs_error for n in a.norms), 1)} (float64)", REFERENCE["jacobian_error"]),
        ]
    return rows


def _table(headers: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        def cells(values):
            return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

        return [cells(headers), "|" + "|".join("---" for _ in headers) + "|"] + [cells(r) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    return [line.rstrip(), "  ".join("-" * w for w in widths)] + [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _cost(share: float, digits: int = 2) -> str:
    """The deletion cost of a share, in percent."""
    return f"{100 * geometry.deletion_cost(share):.{digits}f}%" if math.isfinite(share) else "nan"


def _norm_rows(a: Analysis) -> list[list[str]]:
    probes = {n.name: n for n in a.norms}
    roles = {info.name: info.role for info in a.result.norms}
    out = []
    for f, _ in a.per_norm():
        s, n = f.stats, probes.get(f.name)
        out.append([a.short(f.name), roles.get(f.name) or "-", _f(s.share_median), _f(s.share_p90),
                    _f(s.share_max), _f(a.result.figures.baseline(f.name)[1]), _cost(s.share_median),
                    _f(f.rms, 2), _f(f.inv_sigma), _f(f.eps_over_var, 1), _f(n.gain_spread, 2) if n else "-"])
    return out


NORM_HEADERS = ["norm", "role", "share med", "p90", "max", "rand max", "del. cost", "rms", "1/sigma",
                "eps/v", "gain spread"]


def _header(a: Analysis) -> list[str]:
    c = a.config
    norm = {"layer": "LayerNorm", "rms": "RMSNorm"}.get(c.get("norm"), c.get("norm"))
    step = f", step {a.step}" if a.step is not None else ""
    return [
        f"checkpoint: {a.checkpoint or '(a module in memory)'}{step}",
        f"model: width {c.get('width')}, depth {c.get('depth')}, heads {c.get('heads')}, context "
        f"{c.get('context')}, {norm} eps {c.get('eps'):g}, {len(c.get('vocab', ''))} symbols",
        f"measured on: {a.data or 'the given text'}, {a.batches} held-out batches, {a.rows} rows per norm "
        f"(validation loss {a.val_loss:.4f} nats/char), in {a.seconds:.1f} s",
    ]


def to_terminal(a: Analysis) -> str:
    """The compact tables printed by ``lnmonitor analyze``."""
    lines = _header(a) + [""]
    lines += _table(["quantity", "this model", "study"], [list(r) for r in headline_rows(a)], markdown=False)
    lines += [STUDY_NOTE, "", "per norm (the monitors' figures: dead-plane shares of w = g * dL/dy, medians "
              "over the measured rows; gain spread at one row):"]
    lines += _table(NORM_HEADERS, _norm_rows(a), markdown=False)
    if a.blocks:
        lines += ["", f"block vs branch Jacobian at position {a.position} ({a.blocks[0].rank_rule}):"]
        lines += _table(
            ["block", "rank", "sv min", "sv max", "branch", "rank", "@rtol 1e-6", "sv min", "sv max"],
            [[a.short(b.name), f"{b.block_rank}/{b.width}", _f(b.block_sv_min), _f(b.block_sv_max),
              b.branch, f"{b.branch_rank}/{b.width}", str(_rank_at(b.branch_singular_values, 1e-6)),
              _f(b.branch_sv_min), _f(b.branch_sv_max)] for b in a.blocks], markdown=False)
    return "\n".join(lines)


def to_markdown(a: Analysis, figures: dict[str, str] | None = None) -> str:
    """``analysis.md``: every table, with the figures linked (``figures``: name -> file name)."""
    md = ["# lnmonitor analyze", ""] + [f"- {line}" for line in _header(a)]
    md += ["", "## Headline figures, next to the study", ""]
    md += _table(["quantity", "this model", "study"], [list(r) for r in headline_rows(a)], True)
    md += ["", "The study used a 65-symbol corpus; a different text changes the loss and the vocabulary, "
           "not the geometry being compared. " + STUDY_NOTE, ""]

    md += ["## Norm Jacobians at one row", "",
           f"Row: position {a.position} of the first held-out sequence. Closed form "
           "(`geometry.jacobian`) against autograd, both float64. Rank rule: "
           f"{a.norms[0].rank_rule if a.norms else '-'}. Gain spread: max/min nonzero singular "
           "value of diag(g)(1/sigma)P.", ""]
    md += _table(
        ["norm", "max abs error", "max abs entry", "rank (eps)", "rank (eps=0)", "1/sigma at this row",
         "transmission eps/(v+eps) at this row", "gain spread", "gain sv min .. max"],
        [[a.short(n.name), _f(n.max_abs_error, 1), _f(n.max_abs_entry), f"{n.rank}/{n.width}",
          f"{n.rank_eps0}/{n.width}", _f(n.inv_sigma), _f(n.transmission, 2), _f(n.gain_spread, 3),
          f"{_f(n.gain_sv_min)} .. {_f(n.gain_sv_max)}"] for n in a.norms], True)
    if a.blocks:
        md += ["", "## Block versus branch rank at one position", "",
               f"d block(h)[p] / d h[p] at p = {a.position}, other positions held fixed (float64). "
               f"Rank rule: {a.blocks[0].rank_rule}.", ""]
        md += _table(
            ["block", "rank", "tol", "sv min", "sv max", "branch", "rank", "tol", "sv min", "sv max"],
            [[a.short(b.name), f"{b.block_rank}/{b.width}", _f(b.block_tol, 2), _f(b.block_sv_min),
              _f(b.block_sv_max), b.branch, f"{b.branch_rank}/{b.width}", _f(b.branch_tol, 2),
              _f(b.branch_sv_min), _f(b.branch_sv_max)] for b in a.blocks], True)
        width = a.blocks[0].width
        rtols = sorted((*RTOLS, float32_rtol(width)))
        rtols_note = (f"{float32_rtol(width):.2g} = {width} x 2^-23 is torch.linalg.matrix_rank's default "
                      "for a float32 matrix")
        md += ["", "The branch spectrum trails off rather than stopping, so its rank depends on the "
               "tolerance; the norm deletes the all-ones direction exactly and passes the scale "
               "direction only at eps/(v+eps). Ranks at tolerances relative to the largest singular value "
               f"({rtols_note}):", ""]
        md += _table(
            ["block", *(f"block @{r:.2g}" for r in rtols), *(f"branch @{r:.2g}" for r in rtols)],
            [[a.short(b.name), *(str(_rank_at(b.block_singular_values, r)) for r in rtols),
              *(str(_rank_at(b.branch_singular_values, r)) for r in rtols)] for b in a.blocks], True)
    md += _share_section(a)
    md += _ladder_section(a)
    if a.study:
        md += ["", "### The same stream, as the study computed it", "",
               f"On the first {a.study_sequences} held-out sequences: rms is the global rms over all their "
               "rows and features (ours above: the median row's, over every measured row), std the median "
               "over rows of the per-row unbiased std, without eps (ours: sqrt(v + eps) of the median row). "
               "Each pair measures the same stream with a different statistic.", ""]
        ours = a.result.figures.by_name()
        md += _table(
            ["norm", "rms, median row (ours)", "global rms (study)", "sigma, median row (ours)",
             "median unbiased std (study)"],
            [[a.short(r.name), _f(ours[r.name].rms), _f(r.rms), _f(ours[r.name].sigma), _f(r.std)]
             for r in a.study], True)
    inv = a.invariance
    if inv is not None:
        md += ["", "## Final-norm invariance", "",
               f"Final norm {a.short(inv.final_norm)} ({inv.kind}, eps {inv.eps:g}), {inv.rows} rows, "
               f"base loss {inv.base_loss:.4f}.", ""]
        md += _table(
            ["case", "dloss", "max dlogit", "norm-output residual", "expected |a sigma/sigma_a - 1|"],
            [[c.case, _f(c.dloss, 2), _f(c.max_dlogit, 2), _f(c.out_residual, 2),
              _f(c.expected_residual, 2)] for c in inv.cases.values()], True)
        md += ["", "### Scale sweep", ""]
        md += _table(["a", "eps/v", "dloss", "in fit", "float32 rounding"], [
            [f"{p.scale:g}", _f(p.eps_over_var, 2), _f(p.dloss, 2), "yes" if p.in_fit else "",
             "yes" if p.rounding else ""] for p in inv.sweep], True)
        md += ["", f"Fit of log|dloss| against log(eps/v): slope {_f(inv.slope)}, "
               f"constant {_f(inv.constant)}."]
    if figures:
        md += ["", "## Figures", ""] + [f"![{name}]({fname})" for name, fname in figures.items()]
    return "\n".join(md) + "\n"


def _share_section(a: Analysis) -> list[str]:
    md = ["", "## Dead-plane shares", "",
          "Share of w = g * dL/dy in the dead subspace, over every held-out row, as the monitors measure "
          "it (lnmonitor/share_*); random: a uniformly random direction (median), and the median of the "
          "max of the same number of random rows (lnmonitor/share_baseline/*). "
          "Deletion cost: 1 - sqrt(1 - median^2).", ""]
    rows = []
    for f, _ in a.per_norm():
        s, (base_median, base_max) = f.stats, a.result.figures.baseline(f.name)
        rows.append([a.short(f.name), str(s.share_rows), str(s.skipped_rows), _f(s.share_median),
                     _f(s.share_p90), _f(s.share_max), _f(base_median), _f(base_max),
                     _cost(s.share_median, 3), _cost(base_median, 3)])
    return md + _table(["norm", "rows", "skipped", "median", "p90", "max", "random median", "random max",
                        "deletion cost", "random deletion cost"], rows, True)


def _ladder_section(a: Analysis) -> list[str]:
    figures = a.result.figures
    md = ["", "## The 1/sigma ladder", "",
          f"Medians over rows of the stream each rung reads (the norms that read the residual stream, "
          f"in forward order; final norm {a.short(figures.final) if figures.final else 'none'}).", ""]
    md += _table(["point", "norm", "rms", "sigma", "1/sigma", "eps/v"], [
        [a.labels.get(r.name, f"input of {r.name}"), a.short(r.name), _f(r.rms), _f(r.sigma),
         _f(r.inv_sigma), _f(r.eps_over_var, 2)] for r in a.rungs], True)
    return md + ["", f"Attenuation 1/sigma(first) / 1/sigma(last) = {_f(figures.attenuation)}; "
                 f"growth rms(last) / rms(first) = {_f(figures.growth)}."]


def to_json(a: Analysis) -> dict:
    """A JSON-ready dict (non-finite numbers null); ``metrics`` are the meter's figures under the monitors'
    names, ``roles`` and ``ladder`` say which norms are rungs."""
    out = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name != "result"}
    for key in ("norms", "blocks", "study"):
        out[key] = [dataclasses.asdict(x) for x in out[key]]
    figures = a.result.figures
    out["metrics"] = a.result.metrics(positions=True)
    out["roles"] = {info.name: info.role for info in a.result.norms}
    out["ladder"] = {"rungs": figures.rungs, "final": figures.final, "attenuation": figures.attenuation,
                     "growth": figures.growth}
    if a.invariance is not None:
        out["invariance"] = dataclasses.asdict(a.invariance)
    columns = ("quantity", "this_model", "study")
    out["headline"] = [dict(zip(columns, r, strict=True)) for r in headline_rows(a)]
    return finite(out)


def write_outputs(a: Analysis, folder: str | Path, *, figures: bool = True) -> dict[str, Path]:
    """``analysis.md``, ``analysis.json`` and (unless ``figures=False``) the PNGs in ``folder``."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        made = write_figures(a, folder) if figures else {}
        md, js = folder / "analysis.md", folder / "analysis.json"
        md.write_text(to_markdown(a, made), encoding="utf-8")
        js.write_text(json.dumps(to_json(a), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the analysis to {str(folder)!r}: {err.strerror or err}") from None
    out = {"markdown": md, "json": js}
    out.update({name: folder / fname for name, fname in made.items()})
    return out

