"""Every norm's rows on held-out batches, in float64: the dead-plane shares
against the random baseline and the 1/sigma ladder.

:func:`measure_norm_rows` runs one forward and backward per held-out batch with hooks on
every norm: the dead-plane share of ``w = g * dL/dy`` per row (against the exact random
baseline of the same number of rows, with the deletion cost of the median) and the
statistics of the stream each norm reads.  In a pre-norm model the norms' inputs *are*
the residual-stream points (embedding, after each attention, after each MLP), in call
order.  :func:`share_table` and :func:`sigma_ladder` turn the rows into tables.  This is
the float64 reference behind the live monitors' float32 figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from lnmonitor.core import geometry
from lnmonitor.core.hooks import Hooks
from lnmonitor.core.kinds import NormKind
from lnmonitor.core.ladder import NormStats, baseline_max, baseline_median, ladder_figures
from lnmonitor.core.norms import NormInfo

__all__ = ["LadderRow", "NormRows", "ShareRow", "measure_norm_rows", "share_table", "sigma_ladder"]

_F64 = torch.float64


@dataclass
class NormRows:
    """Per-row measurements of one norm over held-out batches (numpy float64 arrays).

    ``share``: dead-plane share of ``w = g * dL/dy`` on the valid rows; ``skipped``: rows
    without information (``w = 0``, non-finite, constant row).  ``var``: the norm's input
    variance ``v`` per row (the second moment for RMSNorm); ``ms``: ``mean(x^2)`` of the
    input (the stream the norm reads).
    """

    name: str
    kind: NormKind
    width: int
    eps: float
    share: np.ndarray
    skipped: int
    var: np.ndarray
    ms: np.ndarray

    @property
    def sigma(self) -> np.ndarray:
        """``sqrt(v + eps)`` per row."""
        return np.sqrt(self.var + self.eps)

    @property
    def rms(self) -> np.ndarray:
        """``sqrt(mean(x^2))`` per row."""
        return np.sqrt(self.ms)

    def stats(self) -> NormStats:
        """The medians every figure is computed from (:mod:`lnmonitor.core.ladder`)."""

        def median(a: np.ndarray) -> float:
            return float(np.median(a)) if a.size else math.nan

        n = int(self.share.size)
        return NormStats(
            name=self.name, kind=self.kind, width=self.width, eps=self.eps, var=median(self.var),
            ms=median(self.ms), share_median=median(self.share),
            share_p90=float(np.quantile(self.share, 0.9)) if n else math.nan,
            share_max=float(self.share.max()) if n else math.nan, share_rows=n, skipped_rows=self.skipped,
        )


class _Capture(Hooks):
    """Forward hooks that keep each norm's input and output and a gradient hook on the output."""

    def __init__(self, norms) -> None:
        super().__init__()
        self.norms = list(norms)
        self.calls: list[list[tuple[Tensor, dict, Tensor]]] = [[] for _ in self.norms]
        self.order: list[int] = []
        for i, info in enumerate(self.norms):
            self.forward(info.module, self._hook(i))

    def _hook(self, index: int):
        def hook(module, args, output):
            if index not in self.order:
                self.order.append(index)
            if not (args and isinstance(args[0], Tensor) and isinstance(output, Tensor)):
                return
            box: dict = {}
            self.calls[index].append((args[0].detach(), box, output))
            if output.requires_grad:
                output.register_hook(lambda grad: box.__setitem__("grad", grad.detach()))

        return hook


def measure_norm_rows(
    model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], Tensor],
    norms: Sequence[NormInfo],
) -> list[NormRows]:
    """One forward and backward per batch with hooks on every norm's input and output gradient.

    ``loss_fn(model, batch)`` returns the scalar loss (e.g. ``lambda m, b: m(*b)[1]``);
    ``norms`` are the model's norms (:func:`lnmonitor.core.norms.find_norms`).  Gradients are
    taken with respect to the norms' outputs only, so the parameters' ``.grad`` are left as they were.  The
    result lists the norms in the order they are first called: for a pre-norm model that
    is the residual-stream ladder (the first norm reads the embedding, the last the final
    stream).  Rows are evaluated in float64 on the CPU.
    """
    norms = list(norms)
    if not norms:
        raise ValueError("the model has no normalisation layer lnmonitor recognises")
    parts: list[dict] = [
        {"share": [], "skipped": 0, "var": [], "ms": [], "width": info.width}
        for info in norms
    ]
    order: list[int] = []
    for batch in batches:
        with torch.inference_mode(False), torch.enable_grad(), _Capture(norms) as cap:
            loss = loss_fn(model, batch)
            if not isinstance(loss, Tensor) or loss.ndim != 0 or not loss.requires_grad:
                raise ValueError("loss_fn must return a scalar tensor with a graph (the batch's loss)")
            outputs = [out for calls in cap.calls for _, _, out in calls if out.requires_grad]
            torch.autograd.grad(loss, outputs, allow_unused=True)
        order += [i for i in cap.order if i not in order]
        for i, info in enumerate(norms):
            eps = info.eps(torch.float32)
            weight = info.gain()
            w = None if weight is None else weight.detach().reshape(-1).to("cpu", _F64)
            part = parts[i]
            for x, box, _ in cap.calls[i]:
                xr = x.reshape(-1, x.shape[-1]).to("cpu", _F64)
                part["width"] = xr.shape[-1]
                st = geometry.row_stats(xr, eps, info.kind)
                part["var"].append(st.var.numpy())
                part["ms"].append(xr.pow(2).mean(-1).numpy())
                grad = box.get("grad")
                if grad is None:
                    part["skipped"] += xr.shape[0]
                    continue
                share, valid = geometry.dead_plane_share(
                    xr, grad.reshape(xr.shape).to("cpu", _F64), info.kind, w
                )
                part["share"].append(share[valid].numpy())
                part["skipped"] += int((~valid).sum())
        del cap
    order += [i for i in range(len(norms)) if i not in order]

    def cat(chunks: list) -> np.ndarray:
        return np.concatenate(chunks) if chunks else np.zeros(0)

    return [
        NormRows(
            name=norms[i].name, kind=norms[i].kind, width=int(parts[i]["width"] or 0),
            eps=norms[i].eps(torch.float32), share=cat(parts[i]["share"]), skipped=parts[i]["skipped"],
            var=cat(parts[i]["var"]), ms=cat(parts[i]["ms"]),
        )
        for i in order
    ]


@dataclass(frozen=True)
class ShareRow:
    """Dead-plane shares of one norm against the random baseline (docs/design.md).

    ``baseline_median``: the median share of a random direction (k = 2 LayerNorm, 1
    RMSNorm); ``baseline_max``: the median of the max of ``rows`` random shares, the fair
    comparison for ``max``.  ``deletion_cost``: ``1 - sqrt(1 - median^2)``, the relative
    length the norm deletes from the median row's gradient.
    """

    name: str
    kind: NormKind
    width: int
    rows: int
    skipped: int
    median: float
    p90: float
    max: float
    rms: float
    baseline_median: float
    baseline_rms: float
    baseline_max: float
    deletion_cost: float
    baseline_deletion_cost: float


def share_table(rows: Sequence[NormRows]) -> list[ShareRow]:
    """The dead-plane share table: one :class:`ShareRow` per norm (nan without valid rows)."""
    table = []
    for r in rows:
        k = geometry.dead_dim(r.kind)
        s = r.stats()
        n = s.share_rows
        base_med = baseline_median(r.width, k)
        table.append(ShareRow(
            name=r.name, kind=r.kind, width=r.width, rows=n, skipped=r.skipped, median=s.share_median,
            p90=s.share_p90, max=s.share_max, rms=float(np.sqrt(np.mean(r.share**2))) if n else math.nan,
            baseline_median=base_med, baseline_rms=geometry.share_rms(r.width, k),
            baseline_max=baseline_max(r.width, k, n) if n else math.nan,
            deletion_cost=geometry.deletion_cost(s.share_median) if n else math.nan,
            baseline_deletion_cost=geometry.deletion_cost(base_med),
        ))
    return table


@dataclass(frozen=True)
class LadderRow:
    """The stream one norm reads: its figures from the medians over rows
    (:class:`lnmonitor.core.ladder.NormFigures`); ``inv_sigma = 1/sigma`` is the gain the norm
    applies to everything it passes."""

    name: str
    point: str
    sigma: float
    inv_sigma: float
    rms: float
    eps_over_var: float
    transmission: float


def sigma_ladder(
    rows: Sequence[NormRows], labels: dict[str, str] | None = None
) -> tuple[list[LadderRow], float, float]:
    """``(ladder, attenuation, growth)`` over the norms in call order, every norm a rung
    (:func:`lnmonitor.core.ladder.ladder_figures`: ``attenuation = inv_sigma(first) /
    inv_sigma(last)``, ``growth = rms(last) / rms(first)``).  ``labels`` maps a norm name
    to the residual-stream point it reads (default ``"input of <name>"``).
    """
    labels = labels or {}
    figures = ladder_figures([r.stats() for r in rows], [r.name for r in rows])
    ladder = [
        LadderRow(name=f.name, point=labels.get(f.name, f"input of {f.name}"), sigma=f.sigma,
                  inv_sigma=f.inv_sigma, rms=f.rms, eps_over_var=f.eps_over_var, transmission=f.transmission)
        for f in figures.norms
    ]
    return ladder, figures.attenuation, figures.growth
