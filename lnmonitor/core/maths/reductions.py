"""The per-row reductions the norm taps compute.

Each reduction turns a norm's rows into five float32 numbers per row (:data:`FIELDS`),
on the device, with no host synchronisation, in two halves: a few passes over the
call's ``(rows, d)`` tensors in the backward hook (``*_raw``), the rest once per step
for all calls together (``finish_*``); :func:`row_values` turns those into the
per-row share and statistics.  They must equal the reference maths of
:mod:`lnmonitor.core.maths.geometry` (``normalise``, ``dead_plane_share``) to float32 rounding:
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
    "CHUNK_ELEMENTS", "FIELDS", "ROUNDING_ROW", "chunk_rows", "drop_rounding_rows",
    "finish_layernorm_backward", "finish_rows", "forward_raw", "layernorm_backward_raw",
    "mask_rows", "row_raw", "row_values", "stack_raw",
]

FIELDS = ("var", "ms", "sw", "ww", "wx2v")
# A row whose |w| is below this fraction of the rms |w| of its call carries no information:
# a structural zero (the query at position 0 of causal attention gets none) that float32
# rounding of the other rows' terms turns into noise.  Its share is noise: it is skipped.
ROUNDING_ROW = 1e-5


def drop_rounding_rows(red: Tensor) -> Tensor:
    """``red`` (:data:`FIELDS` x rows, or :data:`FIELDS` x calls x rows: each call on its
    own) with ``ww`` (``|w|^2``: not negative, or nan) set to 0 on the finite rows at or
    below :data:`ROUNDING_ROW` of the call's mean over its finite rows, so that they are
    skipped and counted; in place, one reduction, no ``where`` (slow on small CPU tensors)."""
    ww = red[3]
    kept = ww.nan_to_num(0.0, 0.0, 0.0)  # the finite rows' ww, 0 on the others
    finite = kept == ww  # (isfinite is several operators on a CPU)
    mean = kept.sum(-1, keepdim=True) / finite.sum(-1, keepdim=True).clamp_(min=1)
    ww.sub_(kept * (kept <= (ROUNDING_ROW**2) * mean))  # ww - ww = 0 there; the rest as they were
    return red


def mask_rows(red: Tensor, keep: Tensor) -> Tensor:
    """``red`` with every statistic of the rows where ``keep`` is False made nan (padding: no
    histogram counts them, and :func:`drop_rounding_rows` leaves them out of its mean)."""
    return red * torch.where(keep, red.new_ones(()), math.nan)  # one row's where: (5, rows) is slow on a CPU


# rows are reduced in chunks of at most this many elements, so that a call's float32
# temporaries (``w``, the centred input, a low-precision input's float32 copy) stay a few MB
# however wide the norm and long the batch
CHUNK_ELEMENTS = 1 << 20


def chunk_rows(d: int) -> int:
    """The rows of a width-``d`` norm reduced together (see :data:`CHUNK_ELEMENTS`)."""
    return max(1, CHUNK_ELEMENTS // d)


def _buffers(workspace, n: int, d: int):
    """Views ``(n, d)`` of the workspace's flat buffers (None where it has none, or too small)."""
    ws = workspace or ()
    return tuple(b[: n * d].view(n, d) if b.numel() >= n * d else None for b in ws) + (None,) * (2 - len(ws))


def _float(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _gain(weight: Tensor | None) -> Tensor | None:
    return None if weight is None else _float(weight.detach().reshape(-1))


def _by_chunks(fn, d: int, *rows: Tensor) -> tuple[Tensor, ...]:
    """``fn``'s per-row tensors for the ``(n, d)`` tensors ``rows``, which it gets in float32 a
    chunk of :func:`chunk_rows` rows at a time (all at once when they fit one), joined."""
    step = chunk_rows(d)
    if rows[0].shape[0] <= step:  # the usual call: one chunk
        return fn(*map(_float, rows))
    parts = [fn(*(_float(t[a : a + step]) for t in rows)) for a in range(0, rows[0].shape[0], step)]
    return tuple(torch.cat(field) for field in zip(*parts, strict=True))


def stack_raw(raws) -> Tensor:
    """The raw rows of calls (each a tuple of :data:`FIELDS`-many per-row float32 tensors, as
    the ``*_raw`` functions return them) side by side, as the ``finish_*`` functions take them:
    ``(5, rows)``, one copy."""
    rows = sum(raw[0].shape[0] for raw in raws)
    return torch.cat([t for field in zip(*raws, strict=True) for t in field]).view(len(FIELDS), rows)


# The hot path.  A hook computes only the passes over a call's (rows, d) tensors, as five
# raw numbers per row (a tuple of per-row tensors, joined for all calls by one copy,
# :func:`stack_raw`); everything per row after that (squares, var from rstd, the share's
# terms, the rounding rows, the padding) runs once per measured step on all calls together
# (:func:`finish_rows`, :func:`finish_layernorm_backward`, called by the taps' ``collect``), so
# the backward pays for a few large operators per norm and no chain of small ones.


def forward_raw(x: Tensor, kind: NormKind) -> tuple[Tensor, ...]:
    """The raw rows of :func:`row_raw` for a call without gradient: zero ``w``."""
    x = _float(x.detach().reshape(-1, x.shape[-1]))
    d, zero = x.shape[-1], x.new_zeros(x.shape[0])
    if kind == "layer":
        mu = torch.sum(x, dim=-1).div_(d)
        return mu, torch.linalg.vector_norm(x - mu.unsqueeze(-1), dim=-1), zero, zero, zero
    return zero, torch.linalg.vector_norm(x, dim=-1), zero, zero, zero


def row_raw(
    x: Tensor,
    grad_output: Tensor,
    kind: NormKind,
    weight: Tensor | None = None,
    workspace: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, ...]:
    """The hot half of the per-row reductions from a norm's input: five float32 ``(rows,)`` tensors
    ``mu``
    (RMSNorm: 0), ``|x - mu|`` (RMSNorm: ``|x|``), ``sum(w)``, ``|w|`` and ``w . (x - mu)``.
    The ``(rows, d)`` temporaries go into ``workspace`` when given; no host synchronisation."""
    d = x.shape[-1]
    gamma = _gain(weight)

    def chunk(x: Tensor, g: Tensor) -> tuple[Tensor, ...]:
        buf_w, buf_x = _buffers(workspace, x.shape[0], d)
        w = g if gamma is None else torch.mul(g, gamma, out=buf_w)
        sw, wn = torch.sum(w, dim=-1), torch.linalg.vector_norm(w, dim=-1)
        if kind == "layer":
            mu = torch.sum(x, dim=-1).div_(d)
            xc = torch.sub(x, mu.unsqueeze(-1), out=buf_x)
            return mu, torch.linalg.vector_norm(xc, dim=-1), sw, wn, torch.sum(xc.mul_(w), dim=-1)
        xw = torch.sum(torch.mul(x, w, out=buf_x), dim=-1)
        return x.new_zeros(x.shape[0]), torch.linalg.vector_norm(x, dim=-1), sw, wn, xw

    return _by_chunks(chunk, d, x.detach().reshape(-1, d), grad_output.detach().reshape(-1, d))


def finish_rows(raw: Tensor, kind: NormKind, d: int) -> Tensor:
    """:data:`FIELDS` from the raw rows of :func:`row_raw` (any number of calls of one kind
    and width, side by side)."""
    mu, xn, sw, wn, wx = raw.unbind(0)
    if kind == "layer":
        var = xn.square().div_(d)
        ms = var + mu * mu
    else:
        ms = xn.square().div_(d)
        var = ms
    return torch.stack((var, ms, sw, wn.square(), wx.square().div_(var)))


def layernorm_backward_raw(
    grad_output: Tensor,
    grad_input: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None = None,
    workspace: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor, ...]:
    """The hot half of the reductions from what a LayerNorm's backward already has: five
    float32 ``(rows,)`` tensors ``rstd``, ``mean`` (views of the saved ones when float32),
    ``sum(w)``, ``|w|`` and ``|grad_input|``."""
    d = grad_output.shape[-1]
    gamma = _gain(weight)

    def chunk(g: Tensor, dx: Tensor) -> tuple[Tensor, ...]:
        if gamma is None:
            sw, w = torch.sum(g, dim=-1), g
        else:
            sw, w = torch.mv(g, gamma), torch.mul(g, gamma, out=_buffers(workspace, g.shape[0], d)[0])
        return sw, torch.linalg.vector_norm(w, dim=-1), torch.linalg.vector_norm(dx, dim=-1)

    passes = _by_chunks(chunk, d, grad_output.detach().reshape(-1, d), grad_input.detach().reshape(-1, d))
    return _float(rstd.detach().reshape(-1)), _float(mean.detach().reshape(-1)), *passes


def finish_layernorm_backward(raw: Tensor, eps: float, d: int) -> Tensor:
    """:data:`FIELDS` from the raw rows of :func:`layernorm_backward_raw` (any number of calls
    with one eps and width, side by side), without reading the input again: from the saved
    per-row ``mean`` and ``rstd = 1/sqrt(var + eps)``, ``grad_output = dL/dy`` and
    ``grad_input``, the gradient the norm passes to its input.

    ``var = 1/rstd^2 - eps`` (0, a constant row, below ``1e-5 eps``); and since
    ``grad_input = rstd (w - sum(w)/d - (w.xhat/d) xhat)`` with ``|xhat|^2 = d (1 - t)``,
    ``t = eps/(var + eps)``:
    ``wx2v = (d |w|^2 - sum(w)^2 - d |grad_input|^2 / rstd^2) / (1 - t^2)``.  The share is
    then exact to ~1e-7 / share (1e-4 at a share of 1e-3)."""
    rstd, mu, sw, wn, dxn = raw.unbind(0)
    rs2 = rstd.square()
    var = rs2.reciprocal().sub_(eps)
    # below ~1e-5 eps the subtraction is rounding: treat the row as constant (skipped); nan too
    var = torch.threshold(var.nan_to_num_(0.0, math.inf), 1e-5 * eps, 0.0)
    ms = var + mu * mu
    ww = wn.square()
    dxx = dxn.square().div_(rs2)
    t = rs2.mul_(eps)  # eps / (var + eps)
    wx2v = (ww * d).sub_(sw * sw).sub_(dxx.mul_(d)).div_(1.0 - t.square_())
    return torch.stack((var, ms, sw, ww, wx2v))


def row_values(
    data: Tensor, d: Tensor | float, layer: Tensor | float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-row ``(share, share_ok, var, ms, stat_ok)`` from the ``(5, rows)`` reductions of
    :func:`finish_rows`; ``d`` is the width and ``layer`` 1.0 for
    LayerNorm rows and 0.0 for RMSNorm rows (scalars or per-row tensors).

    ``share^2 = (layer * sw^2 + wx2v) / (d ww)`` (docs/design.md: ``u1 = 1/sqrt(d)``,
    ``u2 = (x - mu)/|x - mu|``, ``|x - mu|^2 = d var``, ``wx2v = (w.(x - mu))^2 / var``);
    ``stat_ok`` marks rows with a finite, positive ``var`` and finite ``ms``; ``share_ok``
    additionally a finite, non-zero ``w``.  ``share`` is 0 where not ``share_ok``.
    """
    var, ms, sw, ww, wx2v = data.unbind(0)
    if isinstance(layer, Tensor) or layer:
        share2 = (layer * sw * sw + wx2v) / (d * ww)
    else:
        share2 = wx2v / (d * ww)
    # the masks as 0/1 floats, several times cheaper than bool on CPU: a maximum is below inf only
    # when both are (it propagates nan), and a comparison with nan is False
    stat = _mask(torch.gt, var, 0.0).mul_(_mask(torch.lt, torch.maximum(var, ms), math.inf))
    ok = _mask(torch.gt, ww, 0.0).mul_(_mask(torch.lt, torch.maximum(ww, share2), math.inf)).mul_(stat)
    share = share2.nan_to_num(0.0, 0.0, 0.0).mul_(ok).clamp_(0.0, 1.0).sqrt_()
    return share, ok.bool(), var, ms, stat.bool()


def _mask(compare, x: Tensor, y: float) -> Tensor:
    return compare(x, y, out=torch.empty_like(x))
