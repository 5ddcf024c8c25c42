"""The whole LayerNorm story of one tiny-GPT checkpoint: probes, tables, JSON and figures.

:func:`load_checkpoint` reads a train-tiny / eps-compare checkpoint safely
(``weights_only=True``; anything wrong is a one-line :class:`UsageError`),
:func:`analyze` runs every probe of :mod:`lnmonitor.probes` plus the final-norm
invariance cases and scale sweep of :mod:`lnmonitor.invariance` on held-out text, and
:func:`write_outputs` writes ``analysis.md``, ``analysis.json`` and the PNG figures.

The probes are model-agnostic; two things here are specific to the tiny GPT and say
so: the loss (``module(x, y)`` returns ``(logits, loss)``) and the names of the
residual-stream points in the ladder (the input of ``blocks.0.ln1`` is the embedding,
of ``blocks.i.ln2`` the stream after block i's attention, of ``blocks.i+1.ln1`` /
``lnf`` the stream after block i's MLP).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lnmonitor import geometry
from lnmonitor.errors import UsageError
from lnmonitor.experiments.store import finite
from lnmonitor.invariance import InvarianceResult, final_norm_invariance
from lnmonitor.probes import (
    BlockRankProbe,
    LadderRow,
    NormJacobianProbe,
    SequenceCapture,
    ShareRow,
    find_blocks,
    measure_norm_rows,
    probe_block_rank,
    probe_norm_jacobian,
    share_table,
    sigma_ladder,
)
from lnmonitor.taps import find_norms

__all__ = [
    "REFERENCE",
    "Analysis",
    "analyze",
    "load_checkpoint",
    "stream_labels",
    "summary_rows",
    "to_json",
    "to_markdown",
    "to_terminal",
    "write_figures",
    "write_outputs",
]

# DESIGN.md section 2: the study this project grew out of (4 x 128 LayerNorm GPT, eps 1e-5,
# 3,000 steps, a 65-symbol character corpus).
REFERENCE = {
    "val_loss": "1.573 (65 symbols)",
    "share_median": "0.087 .. 0.144",
    "share_max_above": "9 of 9",
    "final_share_max": "0.83",
    "block_rank": "128/128",
    "block_sv": "0.36 .. 2.50",
    "branch_rank": "123",
    "rms": "0.90 -> 3.90",
    "inv_sigma": "1.112 -> 0.323 (3.4x)",
    "shift_scale": "0 / 0 (identical)",
    "slope": "0.97 / 0.049",
    "gain_spread": "< 2x",
    "jacobian_error": "-",
}

FIGURES = ("spectrum", "shares", "ladder", "sweep")


# ---------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def _load_error(err: BaseException) -> str:
    """What a ``torch.load(weights_only=True)`` failure means, in one line."""
    text = str(err)
    if isinstance(err, PermissionError):
        return "cannot be read: permission denied"
    if isinstance(err, (OSError, EOFError)) or "zip archive" in text or "central directory" in text:
        return "is truncated or corrupted (its archive is incomplete): write it again or pass another"
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return (f"holds a Python object ({found.group(1)}) that safe loading (weights_only=True) refuses: "
                "it is not a train-tiny or eps-compare checkpoint")
    if "Weights only load failed" in text or "load key" in text or "operand" in text:
        return "is not a PyTorch checkpoint (neither a torch zip archive nor a pickle torch can read)"
    return f"cannot be read as a PyTorch checkpoint: {_first_line(err)}"


def load_checkpoint(path: str | Path):
    """``(module, step)``: the :class:`TinyGPTModule` of a train-tiny or eps-compare checkpoint
    (CPU, eval mode) and its ``global_step`` (None when absent).

    Loaded with ``torch.load(weights_only=True)``, so a checkpoint cannot run code.  A path
    that is not a file, a file that is not a torch checkpoint or is truncated, a checkpoint
    without the module's hyperparameters (e.g. a plain ``state_dict``), or weights whose
    shapes disagree with the hyperparameters each raise :class:`UsageError`.
    """
    from lnmonitor.tiny.module import TinyGPTModule

    path = Path(path)
    if not path.exists():
        raise UsageError(f"checkpoint {str(path)!r} does not exist: pass a .ckpt written by train-tiny")
    if not path.is_file():
        raise UsageError(f"checkpoint {str(path)!r} is not a file: pass a .ckpt written by train-tiny")
    if path.stat().st_size == 0:
        raise UsageError(f"checkpoint {str(path)!r} is empty: pass a .ckpt written by train-tiny")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - every failure to read the file is the same user error
        raise UsageError(f"checkpoint {str(path)!r} {_load_error(err)}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("hyper_parameters"), dict) or (
        not isinstance(ckpt.get("state_dict"), dict)
    ):
        raise UsageError(
            f"checkpoint {str(path)!r} is a torch file but not a train-tiny checkpoint: it lacks the model's "
            "hyperparameters and state_dict (a plain state_dict cannot be analysed; pass last.ckpt)"
        )
    hparams = ckpt["hyper_parameters"]
    accepted = set(inspect.signature(TinyGPTModule.__init__).parameters) - {"self"}
    kwargs = {k: v for k, v in hparams.items() if k in accepted}
    if "vocab" not in kwargs:
        raise UsageError(
            f"checkpoint {str(path)!r} has hyperparameters but no vocabulary: it was not written by "
            "train-tiny or eps-compare"
        )
    try:
        module = TinyGPTModule(**kwargs)
    except (TypeError, ValueError) as err:
        raise UsageError(
            f"checkpoint {str(path)!r} has invalid hyperparameters: {_first_line(err)}"
        ) from None
    try:
        module.load_state_dict(ckpt["state_dict"], strict=True)
    except RuntimeError as err:
        detail = [ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()]
        raise UsageError(
            f"checkpoint {str(path)!r}: the weights do not match the configuration stored with them "
            f"(width {kwargs.get('width')}, depth {kwargs.get('depth')}, vocab {len(kwargs['vocab'])}): "
            f"{detail[0][:200] if detail else _first_line(err)}"
        ) from None
    state = module.state_dict()
    bad = [name for name, t in state.items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:
        more = " and others" if len(bad) > 1 else ""
        raise UsageError(
            f"checkpoint {str(path)!r} has non-finite weights ({bad[0]}{more}): the run diverged; "
            "analyse an earlier checkpoint"
        )
    step = ckpt.get("global_step")
    return module.eval(), (int(step) if isinstance(step, int) else None)


# ---------------------------------------------------------------------------
# the analysis
# ---------------------------------------------------------------------------


@dataclass
class Analysis:
    """Everything :func:`analyze` measured.  ``share_values`` (per-row shares, for the
    figures) is not written to JSON."""

    checkpoint: str
    step: int | None
    config: dict
    data: str
    batches: int
    rows: int
    val_loss: float
    position: int
    norms: list[NormJacobianProbe]
    blocks: list[BlockRankProbe]
    shares: list[ShareRow]
    ladder: list[LadderRow]
    attenuation: float
    growth: float
    invariance: InvarianceResult | None
    seconds: float = 0.0
    share_values: dict[str, np.ndarray] = field(default_factory=dict, repr=False)


def stream_labels(module) -> dict[str, str]:
    """Names of the residual-stream points the tiny GPT's norms read (specific to TinyGPT:
    pre-norm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, final ``lnf``)."""
    from lnmonitor.tiny.model import TinyGPT

    model = getattr(module, "model", module)
    if not isinstance(model, TinyGPT):
        return {}
    prefix = "model." if model is not module else ""
    depth = len(model.blocks)
    labels = {f"{prefix}blocks.0.ln1": "embedding", f"{prefix}lnf": f"after block {depth - 1} MLP"}
    for i in range(depth):
        labels[f"{prefix}blocks.{i}.ln2"] = f"after block {i} attention"
        if i + 1 < depth:
            labels[f"{prefix}blocks.{i + 1}.ln1"] = f"after block {i} MLP"
    return labels


def _tiny_loss(module, batch):
    return module(*batch)[1]


def analyze(
    module, text: str, *, data_name: str = "", batches: int | None = None, position: int = -1,
    rtol: float | None = None, checkpoint: str = "", step: int | None = None,
    invariance: bool = True,
) -> Analysis:
    """Run every probe on ``module`` (a :class:`TinyGPTModule`) over the held-out windows of ``text``.

    ``batches``: how many held-out batches to measure the shares and the ladder on (all
    when None).  ``position``: the sequence position of the Jacobian probes.  The
    invariance cases and the scale sweep run on the first held-out batch.
    """
    from lnmonitor.tiny.data import CharDataModule

    started = time.perf_counter()
    hp = module.hparams
    context = int(hp["context"])
    if isinstance(position, bool) or not isinstance(position, int) or not -context <= position < context:
        raise UsageError(
            f"position must be an integer in [-{context}, {context}) (the context), got {position}"
        )
    data = CharDataModule(text, vocab=module.vocab, context=context)
    held_out = data.val_batches()
    if batches is not None:
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise UsageError(f"batches must be a positive integer, got {batches!r}")
        held_out = held_out[:batches]
    module = module.eval()
    norms = find_norms(module)
    blocks = find_blocks(module)

    with torch.no_grad(), SequenceCapture(blocks, norms) as cap:
        module(held_out[0][0][:1])
    block_probes = [
        probe_block_rank(block, cap.blocks[name], position=position, name=name, rtol=rtol)
        for name, block in blocks
    ]
    norm_probes = [probe_norm_jacobian(info, cap.norms[info.name][position], rtol=rtol) for info in norms]

    losses: list[tuple[float, int]] = []

    def loss_fn(m, batch):
        loss = _tiny_loss(m, batch)
        losses.append((float(loss.detach()), int(batch[0].shape[0])))
        return loss

    rows = measure_norm_rows(module, held_out, loss_fn, norms)
    ladder, attenuation, growth = sigma_ladder(rows, stream_labels(module))
    inv = final_norm_invariance(module, held_out[0]) if invariance else None
    count = sum(n for _, n in losses)
    return Analysis(
        checkpoint=str(checkpoint), step=step, config=dict(hp), data=data_name, batches=len(held_out),
        rows=count * context, val_loss=sum(v * n for v, n in losses) / count,
        position=position % context, norms=norm_probes, blocks=block_probes, shares=share_table(rows),
        ladder=ladder, attenuation=attenuation, growth=growth, invariance=inv,
        seconds=time.perf_counter() - started, share_values={r.name: r.share for r in rows},
    )


# ---------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------


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


def _short(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _range(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return _f(lo) if lo == hi else f"{_f(lo)} .. {_f(hi)}"


RTOLS = (1e-12, 1e-9, 1e-6, 1e-3)


def _rank_at(singular_values, rtol: float) -> int:
    """Numerical rank of a stored spectrum at a tolerance relative to its largest value."""
    sv = np.asarray(singular_values, dtype=float)
    return int((sv > rtol * sv.max()).sum()) if sv.size else 0


def summary_rows(a: Analysis) -> list[tuple[str, str, str]]:
    """``(quantity, this model, study)`` rows: the compact side-by-side table."""
    width = int(a.config.get("width", 0))
    shares = [s for s in a.shares if s.rows]
    final = a.shares[-1] if a.shares else None
    above = sum(1 for s in shares if s.max > s.baseline_max)
    kind = a.shares[0].kind if a.shares else "layer"
    k = geometry.dead_dim(kind)
    vocab = len(a.config.get("vocab", ""))
    rows = [
        ("validation loss, nats/char", f"{a.val_loss:.3f} ({vocab} symbols)", REFERENCE["val_loss"]),
        (
            "median share, per norm",
            f"{_range(s.median for s in shares)} (random {_f(geometry.share_median(width, k))})",
            REFERENCE["share_median"] + " (random 0.105)",
        ),
        ("norms whose max share beats random max", f"{above} of {len(shares)}", REFERENCE["share_max_above"]),
        (
            "final norm max share",
            f"{_f(final.max)} (random max {_f(final.baseline_max)})" if final else "-",
            REFERENCE["final_share_max"],
        ),
    ]
    if a.blocks:
        ranks = sorted({b.block_rank for b in a.blocks})
        loose = _range(_rank_at(b.branch_singular_values, 1e-6) for b in a.blocks)
        rows += [
            ("block rank at one position", f"{'/'.join(map(str, ranks))}/{width}", REFERENCE["block_rank"]),
            (
                "block singular values",
                f"{_f(min(b.block_sv_min for b in a.blocks))} .. {_f(max(b.block_sv_max for b in a.blocks))}",
                REFERENCE["block_sv"],
            ),
            (
                f"branch rank ({a.blocks[0].branch})",
                f"{_range(b.branch_rank for b in a.blocks)} ({loose} at rtol 1e-6)",
                REFERENCE["branch_rank"],
            ),
        ]
    if a.ladder:
        first, last = a.ladder[0], a.ladder[-1]
        rows += [
            ("residual rms, first -> last", f"{_f(first.rms, 2)} -> {_f(last.rms, 2)}", REFERENCE["rms"]),
            (
                "1/sigma, first -> last",
                f"{_f(first.inv_sigma)} -> {_f(last.inv_sigma)} ({a.attenuation:.1f}x)",
                REFERENCE["inv_sigma"],
            ),
        ]
    inv = a.invariance
    if inv is not None:
        shift, scale = inv.cases.get("shift_5"), inv.cases.get("scale_3")
        rows += [
            (
                "dloss: shift 5 / scale 3",
                f"{_f(shift.dloss) if shift else '-'} / {_f(scale.dloss) if scale else '-'} "
                f"(float32 ulp of the loss {_f(float(np.spacing(np.float32(inv.base_loss))), 2)})",
                REFERENCE["shift_scale"],
            ),
            ("scale error vs eps/v: slope / constant", f"{_f(inv.slope, 2)} / {_f(inv.constant)}",
             REFERENCE["slope"]),
        ]
    if a.norms:
        rows += [
            ("gain spread, max over norms", f"{_f(max(n.gain_spread for n in a.norms), 2)}x",
             REFERENCE["gain_spread"]),
            (
                "Jacobian vs autograd, max abs error",
                f"{_f(max(n.max_abs_error for n in a.norms), 1)} (float64)",
                REFERENCE["jacobian_error"],
            ),
        ]
    return rows


def _table(headers: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        def cells(values):
            return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

        out = [cells(headers), "|" + "|".join("---" for _ in headers) + "|"]
        out += [cells(r) for r in rows]
        return out
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line.rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return out


def _norm_rows(a: Analysis) -> list[list[str]]:
    probes = {n.name: n for n in a.norms}
    points = {r.name: r for r in a.ladder}
    out = []
    for s in a.shares:
        n, p = probes.get(s.name), points.get(s.name)
        out.append([
            _short(s.name), _f(s.median), _f(s.p90), _f(s.max), _f(s.baseline_max),
            f"{100 * s.deletion_cost:.2f}%" if math.isfinite(s.deletion_cost) else "nan",
            _f(p.rms, 2) if p else "-", _f(p.inv_sigma) if p else "-",
            _f(p.eps_over_var, 1) if p else "-", _f(n.gain_spread, 2) if n else "-",
        ])
    return out


NORM_HEADERS = ["norm", "share med", "p90", "max", "rand max", "del. cost", "rms", "1/sigma",
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
    lines += _table(["quantity", "this model", "study (DESIGN.md 2)"],
                    [list(r) for r in summary_rows(a)], markdown=False)
    lines += ["", "per norm (dead-plane shares of w = g * dL/dy over all rows; ladder medians; "
              "gain spread at one row):"]
    lines += _table(NORM_HEADERS, _norm_rows(a), markdown=False)
    if a.blocks:
        lines += ["", f"block vs branch Jacobian at position {a.position} ({a.blocks[0].rank_rule}):"]
        lines += _table(
            ["block", "rank", "sv min", "sv max", "branch", "rank", "@rtol 1e-6", "sv min", "sv max"],
            [[_short(b.name), f"{b.block_rank}/{b.width}", _f(b.block_sv_min), _f(b.block_sv_max),
              b.branch, f"{b.branch_rank}/{b.width}", str(_rank_at(b.branch_singular_values, 1e-6)),
              _f(b.branch_sv_min), _f(b.branch_sv_max)]
             for b in a.blocks],
            markdown=False,
        )
    return "\n".join(lines)


def to_markdown(a: Analysis, figures: dict[str, str] | None = None) -> str:
    """``analysis.md``: every table, with the figures linked (``figures``: name -> file name)."""
    md = ["# lnmonitor analyze", ""]
    md += [f"- {line}" for line in _header(a)]
    md += ["", "## Summary, next to the study", ""]
    md += _table(["quantity", "this model", "study (DESIGN.md 2)"], [list(r) for r in summary_rows(a)], True)
    md += ["", "The study used a 65-symbol corpus; a different text changes the loss and the vocabulary, "
           "not the geometry being compared.", ""]

    md += ["## Norm Jacobians at one row", "",
           f"Row: position {a.position} of the first held-out sequence. Closed form "
           "(`geometry.jacobian`) against autograd, both float64. Rank rule: "
           f"{a.norms[0].rank_rule if a.norms else '-'}. Gain spread: max/min nonzero singular "
           "value of diag(g)(1/sigma)P.", ""]
    md += _table(
        ["norm", "max abs error", "max abs entry", "rank (eps)", "rank (eps=0)", "1/sigma",
         "transmission eps/(v+eps)", "gain spread", "gain sv min .. max"],
        [[_short(n.name), _f(n.max_abs_error, 1), _f(n.max_abs_entry), f"{n.rank}/{n.width}",
          f"{n.rank_eps0}/{n.width}", _f(n.inv_sigma), _f(n.transmission, 2), _f(n.gain_spread, 3),
          f"{_f(n.gain_sv_min)} .. {_f(n.gain_sv_max)}"] for n in a.norms],
        True,
    )
    if a.blocks:
        md += ["", "## Block versus branch rank at one position", "",
               f"d block(h)[p] / d h[p] at p = {a.position}, other positions held fixed (float64). "
               f"Rank rule: {a.blocks[0].rank_rule}.", ""]
        md += _table(
            ["block", "rank", "tol", "sv min", "sv max", "branch", "rank", "tol", "sv min", "sv max"],
            [[_short(b.name), f"{b.block_rank}/{b.width}", _f(b.block_tol, 2), _f(b.block_sv_min),
              _f(b.block_sv_max), b.branch, f"{b.branch_rank}/{b.width}", _f(b.branch_tol, 2),
              _f(b.branch_sv_min), _f(b.branch_sv_max)] for b in a.blocks],
            True,
        )
        md += ["", "The branch spectrum trails off rather than stopping, so its rank depends on the "
               "tolerance; the norm deletes the all-ones direction exactly and passes the scale "
               "direction only at eps/(v+eps). Ranks at tolerances relative to the largest singular value:",
               ""]
        md += _table(
            ["block", *(f"block @{r:g}" for r in RTOLS), *(f"branch @{r:g}" for r in RTOLS)],
            [[_short(b.name), *(str(_rank_at(b.block_singular_values, r)) for r in RTOLS),
              *(str(_rank_at(b.branch_singular_values, r)) for r in RTOLS)] for b in a.blocks],
            True,
        )
    md += ["", "## Dead-plane shares", "",
           "Share of w = g * dL/dy in the dead subspace, over every held-out row; random: a uniformly "
           "random direction (median), and the median of the max of the same number of random rows. "
           "Deletion cost: 1 - sqrt(1 - median^2).", ""]
    md += _table(
        ["norm", "rows", "skipped", "median", "p90", "max", "rms", "random median", "random max",
         "deletion cost", "random deletion cost"],
        [[_short(s.name), str(s.rows), str(s.skipped), _f(s.median), _f(s.p90), _f(s.max), _f(s.rms),
          _f(s.baseline_median), _f(s.baseline_max), f"{100 * s.deletion_cost:.3f}%",
          f"{100 * s.baseline_deletion_cost:.3f}%"] for s in a.shares],
        True,
    )
    md += ["", "## The 1/sigma ladder", "",
           "Medians over rows of the stream each norm reads (in call order).", ""]
    md += _table(
        ["point", "norm", "rms", "sigma", "1/sigma", "eps/v"],
        [[r.point, _short(r.name), _f(r.rms), _f(r.sigma), _f(r.inv_sigma), _f(r.eps_over_var, 2)]
         for r in a.ladder],
        True,
    )
    md += ["", f"Attenuation 1/sigma(first) / 1/sigma(last) = {_f(a.attenuation)}; "
           f"growth rms(last) / rms(first) = {_f(a.growth)}."]
    inv = a.invariance
    if inv is not None:
        md += ["", "## Final-norm invariance", "",
               f"Final norm {_short(inv.final_norm)} ({inv.kind}, eps {inv.eps:g}), {inv.rows} rows, "
               f"base loss {inv.base_loss:.4f}.", ""]
        md += _table(
            ["case", "dloss", "max dlogit", "norm-output residual", "expected |a sigma/sigma_a - 1|"],
            [[c.case, _f(c.dloss, 2), _f(c.max_dlogit, 2), _f(c.out_residual, 2),
              _f(c.expected_residual, 2)] for c in inv.cases.values()],
            True,
        )
        md += ["", "### Scale sweep", ""]
        md += _table(
            ["a", "eps/v", "dloss", "in fit", "float32 rounding"],
            [[f"{p.scale:g}", _f(p.eps_over_var, 2), _f(p.dloss, 2), "yes" if p.in_fit else "",
              "yes" if p.rounding else ""] for p in inv.sweep],
            True,
        )
        md += ["", f"Fit of log|dloss| against log(eps/v): slope {_f(inv.slope)}, "
               f"constant {_f(inv.constant)}."]
    if figures:
        md += ["", "## Figures", ""]
        md += [f"![{name}]({fname})" for name, fname in figures.items()]
    return "\n".join(md) + "\n"


def to_json(a: Analysis) -> dict:
    """A JSON-ready dict of everything except the per-row shares; non-finite numbers are null."""
    out = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name != "share_values"}
    for key in ("norms", "blocks", "shares", "ladder"):
        out[key] = [dataclasses.asdict(x) for x in out[key]]
    if a.invariance is not None:
        out["invariance"] = dataclasses.asdict(a.invariance)
    out["summary"] = [dict(zip(("quantity", "this_model", "study"), r, strict=True)) for r in summary_rows(a)]
    return finite(out)


# ---------------------------------------------------------------------------
# figures (matplotlib's object API: no pyplot, no global backend state)
# ---------------------------------------------------------------------------


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _fig_spectrum(a: Analysis, path: Path) -> None:
    n = a.norms[-1] if not a.invariance else next(
        (x for x in a.norms if x.name == a.invariance.final_norm), a.norms[-1]
    )
    k = geometry.dead_dim(n.kind)
    floor = 1e-20
    idx = np.arange(1, n.width + 1)
    plain = np.full(n.width, n.inv_sigma)
    plain[n.width - k] = n.transmission * n.inv_sigma
    if k == 2:
        plain[-1] = 0.0
    fig = _figure(7, 4.2)
    ax = fig.add_subplot()
    ax.semilogy(idx, np.maximum(n.singular_values, floor), ".", label=f"with the learned gain, eps={n.eps:g}")
    ax.semilogy(idx, np.maximum(n.singular_values_eps0, floor), "x", ms=4, label="with the gain, eps=0")
    ax.semilogy(idx, np.maximum(plain, floor), "-", lw=1, color="gray",
                label="without gain: 1/sigma (closed form)")
    ax.set_xlabel("index (descending)")
    ax.set_ylabel("singular value")
    ax.set_title(f"{_short(n.name)}: Jacobian spectrum at one row (gain spread {n.gain_spread:.2f}x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def _fig_shares(a: Analysis, path: Path) -> None:
    names = [s.name for s in a.shares]
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig = _figure(3.4 * cols, 2.6 * rows)
    for i, s in enumerate(a.shares):
        ax = fig.add_subplot(rows, cols, i + 1)
        values = a.share_values.get(s.name, np.zeros(0))
        k = geometry.dead_dim(s.kind)
        grid = np.linspace(0, min(1.0, max(0.5, float(values.max()) if values.size else 0.5) * 1.05), 300)
        if values.size:
            ax.hist(values, bins=80, range=(0, grid[-1]), density=True, alpha=0.6, label="observed")
        ax.plot(grid, geometry.share_pdf(grid, s.width, k), "k-", lw=1, label="random direction")
        ax.axvline(s.baseline_max, color="k", ls=":", lw=1, label="random max, same rows")
        if values.size:
            ax.axvline(s.max, color="C3", lw=1, label="observed max")
        ax.set_title(_short(s.name), fontsize=9)
        ax.tick_params(labelsize=7)
        if i == 0:
            ax.legend(fontsize=6)
    fig.suptitle("dead-plane share of w = g * dL/dy against the random baseline", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def _fig_ladder(a: Analysis, path: Path) -> None:
    x = np.arange(len(a.ladder))
    fig = _figure(7.5, 4.2)
    ax = fig.add_subplot()
    ax.plot(x, [r.rms for r in a.ladder], "o-", label="rms of the stream")
    ax.plot(x, [r.inv_sigma for r in a.ladder], "s-", label="1/sigma of the norm reading it")
    ax.set_xticks(x, [r.point for r in a.ladder], rotation=35, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_title(f"the 1/sigma ladder: attenuation {a.attenuation:.2f}x, growth {a.growth:.2f}x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def _fig_sweep(a: Analysis, path: Path) -> None:
    inv = a.invariance
    fig = _figure(6, 4.2)
    ax = fig.add_subplot()
    pts = [p for p in inv.sweep if p.dloss != 0 and math.isfinite(p.dloss)]
    for flag, style, label in ((True, "o", "in fit"), (False, "x", "outside the fit range")):
        sel = [p for p in pts if p.in_fit == flag and not p.rounding]
        if sel:
            ax.loglog([p.eps_over_var for p in sel], [abs(p.dloss) for p in sel], style, label=label)
    rounding = [p for p in pts if p.rounding]
    if rounding:
        ax.loglog([p.eps_over_var for p in rounding], [abs(p.dloss) for p in rounding], "^", color="C3",
                  label="float32 rounding, not eps")
    if math.isfinite(inv.slope):
        xs = np.logspace(-5, 1, 50)
        ax.loglog(xs, inv.constant * xs**inv.slope, "k-", lw=1,
                  label=f"|dloss| = {inv.constant:.3g} (eps/v)^{inv.slope:.2f}")
    ax.set_xlabel("eps / v at the final norm (after scaling by a)")
    ax.set_ylabel("|delta loss|, nats")
    ax.set_title(f"scale sweep of {_short(inv.final_norm)}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def write_figures(a: Analysis, folder: Path, stem: str = "analysis") -> dict[str, str]:
    """Write the PNG figures into ``folder``; returns figure name -> file name."""
    made = {}
    plots = {"spectrum": (_fig_spectrum, bool(a.norms)), "shares": (_fig_shares, bool(a.shares)),
             "ladder": (_fig_ladder, bool(a.ladder)), "sweep": (_fig_sweep, a.invariance is not None)}
    for name, (fn, possible) in plots.items():
        if possible:
            fname = f"{stem}_{name}.png"
            fn(a, folder / fname)
            made[name] = fname
    return made


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

