"""The per-row reductions the norm taps compute on the hot path.

Each reduction turns a norm's rows into five float32 numbers per row (:data:`FIELDS`),
on the device, with no host synchronisation; :func:`row_values` turns those into the
per-row share and statistics.  They must equal the reference maths of
:mod:`lnmonitor.core.geometry` (``row_stats``, ``dead_plane_share``) to float32 rounding:
the tests pin them against it and against float64.

* ``var``: ``mean((x - mu)^2)`` (LayerNorm) or ``mean(x^2)`` (RMSNorm): the norm's own
  variance;
* ``ms``: ``mean(x^2)``, the squared rms of the stream the norm reads;
* ``sw = sum(w)``, ``ww = |w|^2`` and ``wx2v = (w . (x - mu))^2 / var`` (RMSNorm:
  ``(w . x)^2 / var``), with ``w = gain * dL/dy``; then
  ``share^2 = (sw^2 [LayerNorm only] + wx2v) / (d ww)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lnmonitor.core.kinds import NormKind

__all__ = [
    "FIELDS", "ROUNDING_ROW", "drop_rounding_rows", "forward_reductions", "layernorm_backward_reductions",
    "mask_rows", "row_reductions", "row_values",
]

FIELDS = ("var", "ms", "sw", "ww", "wx2v")
# A row whose |w| is below this fraction of the rms |w| of its call carries no information:
# a structural zero (the query at position 0 of causal attention gets none) that float32
# rounding of the other rows' terms turns into noise.  Its share is noise: it is skipped.
ROUNDING_ROW = 1e-5


def drop_rounding_rows(red: Tensor) -> Tensor:
    """``red`` (:data:`FIELDS` x rows) with ``ww`` set to 0 on the rows whose gradient is
    rounding (:data:`ROUNDING_ROW`), so that they are skipped and counted; one reduction."""
    ww = red[3]
    finite = torch.isfinite(ww)
    mean = torch.where(finite, ww, 0.0).sum() / finite.sum().clamp_(min=1)  # of the finite rows
    red[3] = torch.where((ww > (ROUNDING_ROW**2) * mean) | ~finite, ww, 0.0)  # the rest skipped later
    return red


def mask_rows(red: Tensor, keep: Tensor) -> Tensor:
    """``red`` with every statistic of the rows where ``keep`` is False made nan (padding: no
    histogram counts them, and :func:`drop_rounding_rows` leaves them out of its mean)."""
    return torch.where(keep, red, math.nan)


def forward_reductions(x: Tensor, kind: NormKind) -> Tensor:
    """:data:`FIELDS` of rows that get no gradient: :func:`row_reductions` with a zero
    gradient, so ``var`` and ``ms`` are its own and ``sw = ww = 0`` (no share)."""
    return row_reductions(x, torch.zeros_like(x), kind)


def _buffers(workspace, n: int, d: int):
    if workspace is not None and workspace[0].numel() >= n * d:
        return workspace[0][: n * d].view(n, d), workspace[1][: n * d].view(n, d)
    return None, None


def row_reductions(
    x: Tensor,
    grad_output: Tensor,
    kind: NormKind,
    weight: Tensor | None = None,
    workspace: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The five per-row reductions of :data:`FIELDS` as a float32 ``(5, rows)`` tensor:
    ``var`` (LayerNorm: ``mean((x-mu)^2)``; RMSNorm: ``mean(x^2)``), ``ms = mean(x^2)``,
    ``sw = sum(w)``, ``ww = |w|^2`` and ``wx2v = (w . (x - mu))^2 / var`` (RMSNorm:
    ``(w . x)^2 / var``), with ``w = weight * grad_output``.

    ``x`` and ``grad_output`` have shape ``(..., d)``; rows are all leading dimensions.
    Low-precision inputs are promoted to float32; no host synchronisation.  The two
    ``(rows, d)`` float32 temporaries (``w`` and the centred ``x``) are written into
    ``workspace`` (two flat float32 tensors of at least ``rows * d`` elements) when given,
    which spares an allocation and its page faults per call.
    """
    d = x.shape[-1]
    x = x.detach().reshape(-1, d)
    g = grad_output.detach().reshape(-1, d)
    if x.dtype != torch.float32:
        x = x.float()
    if g.dtype != torch.float32:
        g = g.float()
    buf_w, buf_x = _buffers(workspace, x.shape[0], d)
    if weight is not None:
        w = torch.mul(g, weight.detach().reshape(-1).to(torch.float32), out=buf_w)
    else:
        w = g
    sw = w.sum(dim=-1)
    ww = torch.linalg.vector_norm(w, dim=-1).square_()
    if kind == "layer":
        mu = x.sum(dim=-1).div_(d)
        xc = torch.sub(x, mu.unsqueeze(-1), out=buf_x)
        var = torch.linalg.vector_norm(xc, dim=-1).square_().div_(d)
        ms = var + mu * mu
        wx = xc.mul_(w).sum(dim=-1)
    else:
        ms = torch.linalg.vector_norm(x, dim=-1).square_().div_(d)
        var = ms
        wx = torch.mul(x, w, out=buf_x).sum(dim=-1)
    return torch.stack((var, ms, sw, ww, wx.square_().div_(var)))


def layernorm_backward_reductions(
    grad_output: Tensor,
    grad_input: Tensor,
    mean: Tensor,
    rstd: Tensor,
    eps: float,
    weight: Tensor | None = None,
    workspace: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """:func:`row_reductions` for a LayerNorm from what its backward already has, without
    reading the input again: its saved per-row ``mean`` and ``rstd = 1/sqrt(var + eps)``,
    ``grad_output = dL/dy`` and ``grad_input``, the gradient it passes to its input.

    ``var = 1/rstd^2 - eps`` (0, a constant row, below ``1e-5 eps``); and since
    ``grad_input = rstd (w - sum(w)/d - (w.xhat/d) xhat)`` with ``|xhat|^2 = d (1 - t)``,
    ``t = eps/(var + eps)``:
    ``wx2v = (d |w|^2 - sum(w)^2 - d |grad_input|^2 / rstd^2) / (1 - t^2)``.  The share is
    then exact to ~1e-7 / share (1e-4 at a share of 1e-3).
    """
    d = grad_output.shape[-1]
    g = grad_output.detach().reshape(-1, d)
    dx = grad_input.detach().reshape(-1, d)
    if g.dtype != torch.float32:
        g = g.float()
    if dx.dtype != torch.float32:
        dx = dx.float()
    buf_w, _ = _buffers(workspace, g.shape[0], d)
    rs2 = rstd.detach().reshape(-1).to(torch.float32).square()
    mu = mean.detach().reshape(-1).to(torch.float32)
    var = rs2.reciprocal().sub_(eps)
    # below ~1e-5 eps the subtraction is rounding: treat the row as constant (skipped)
    var = torch.where(var > 1e-5 * eps, var, 0.0)
    ms = var + mu * mu
    if weight is not None:
        gamma = weight.detach().reshape(-1).to(torch.float32)
        sw = torch.mv(g, gamma)
        ww = torch.linalg.vector_norm(torch.mul(g, gamma, out=buf_w), dim=-1).square_()
    else:
        sw = g.sum(dim=-1)
        ww = torch.linalg.vector_norm(g, dim=-1).square_()
    dxx = torch.linalg.vector_norm(dx, dim=-1).square_().div_(rs2)
    t = rs2.mul_(eps)  # eps / (var + eps)
    wx2v = (ww * d).sub_(sw * sw).sub_(dxx.mul_(d)).div_(1.0 - t.square_())
    return torch.stack((var, ms, sw, ww, wx2v))


def row_values(
    data: Tensor, d: Tensor | float, layer: Tensor | float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-row ``(share, share_ok, var, ms, stat_ok)`` from the ``(5, rows)`` reductions of
    :func:`row_reductions`; ``d`` is the width and ``layer`` 1.0 for
    LayerNorm rows and 0.0 for RMSNorm rows (scalars or per-row tensors).

    ``share^2 = (layer * sw^2 + wx2v) / (d ww)`` (docs/design.md: ``u1 = 1/sqrt(d)``,
    ``u2 = (x - mu)/|x - mu|``, ``|x - mu|^2 = d var``, ``wx2v = (w.(x - mu))^2 / var``);
    ``stat_ok`` marks rows with a finite, positive ``var`` and finite ``ms``; ``share_ok``
    additionally a finite, non-zero ``w``.  ``share`` is 0 where not ``share_ok``.
    """
    var, ms, sw, ww, wx2v = data.unbind(0)
    inf = math.inf
    # comparisons with nan are False, so these also reject nan
    stat_ok = (var > 0) & (var < inf) & (ms < inf)
    if isinstance(layer, Tensor) or layer:
        share2 = (layer * sw * sw + wx2v) / (d * ww)
    else:
        share2 = wx2v / (d * ww)
    share_ok = stat_ok & (ww > 0) & (ww < inf) & (share2 < inf)
    share = torch.where(share_ok, share2, 0.0).clamp_(0.0, 1.0).sqrt_()
    return share, share_ok, var, ms, stat_ok
