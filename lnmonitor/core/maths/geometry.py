"""Closed-form maths on rows ``x`` in R^d of a norm's input (batched over leading dims; docs/design.md).

* LayerNorm: ``mu = mean(x)``, ``v = mean((x - mu)^2)``, ``sigma = sqrt(v + eps)``,
  ``xhat = (x - mu) / sigma``, ``dy/dx = diag(g) (1/sigma) (I - 11^T/d - xhat xhat^T/d)``.
* RMSNorm: ``r = sqrt(mean(x^2) + eps)``, ``xhat = x / r``, ``dy/dx = diag(g) (1/r) (I - xhat xhat^T/d)``.
* Dead-plane share of ``w = g * dL/dy``: ``|P w| / |w|``, ``P`` the orthogonal projector onto the dead
  subspace (span{1, xhat} for LayerNorm, span{xhat} for RMSNorm).

Tensor functions work in float32 or float64 on any device and never synchronise with the host.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from lnmonitor.core.kinds import NormKind

__all__ = ["Normalised", "dead_basis", "dead_dim", "dead_plane_share", "deletion_cost", "jacobian",
           "normalise", "singular_values", "transmission"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def dead_dim(kind: NormKind) -> int:
    """Dimension k of the dead subspace: 2 for ``"layer"`` (shift, scale), 1 for ``"rms"``."""
    if kind == "layer":
        return 2
    if kind == "rms":
        return 1
    raise ValueError(f"kind must be 'layer' (LayerNorm) or 'rms' (RMSNorm), got {kind!r}")


def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ValueError(f"eps must be a python float >= 0 (the norm's epsilon), got {eps!r}")
    eps = float(eps)
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite float >= 0 (the norm's epsilon), got {eps!r}")
    return eps


def _check_x(x: Tensor, name: str = "x") -> int:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of rows (..., d), got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have shape (..., d) with d >= 1, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x.shape[-1]


def _check_weight(weight: Tensor | None, d: int) -> None:
    if weight is None:
        return
    if not isinstance(weight, Tensor):
        raise ValueError(f"weight must be a torch.Tensor of shape (d,) or None, got {weight!r}")
    if weight.ndim == 0 or weight.shape[-1] != d:
        raise ValueError(f"weight must have last dimension d={d} (the norm's gain), "
                         f"got {tuple(weight.shape)}")


def _work_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Promoted dtype, raised to float32 when it is half or bfloat16."""
    dt = functools.reduce(torch.promote_types, dtypes)
    return torch.float32 if dt in _LOW_PRECISION else dt


class Normalised(NamedTuple):
    """Rows as a norm normalises them: ``mean``, ``var``, ``sigma`` of shape ``x.shape[:-1]``, ``xhat`` of
    ``x.shape``.  For RMSNorm ``mean`` is zero and ``var`` is the second moment ``mean(x^2)``."""

    mean: Tensor
    var: Tensor
    sigma: Tensor
    xhat: Tensor


def normalise(x: Tensor, eps: float, kind: NormKind = "layer") -> Normalised:
    """Each row of ``x`` (..., d) normalised as the norm of ``kind`` does it (no gain or bias), in ``x``'s
    dtype (``var`` biased).  A zero-variance row at ``eps = 0`` gives a non-finite ``xhat``, as the norm."""
    _check_x(x)
    eps = _check_eps(eps)
    k = dead_dim(kind)
    if k == 2:
        mean = x.mean(dim=-1)
        xc = x - mean.unsqueeze(-1)
        var = (xc * xc).mean(dim=-1)
    else:
        mean = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        xc = x
        var = (x * x).mean(dim=-1)
    sigma = torch.sqrt(var + eps)
    return Normalised(mean=mean, var=var, sigma=sigma, xhat=xc / sigma.unsqueeze(-1))


def transmission(var, eps: float):
    """Fraction ``eps / (var + eps)`` the norm passes along the scale direction (``var``: the second moment
    for RMSNorm), as a tensor, numpy array or float like ``var``; a python ``var + eps == 0`` gives nan."""
    eps = _check_eps(eps)
    if isinstance(var, Tensor | np.ndarray):
        return eps / (var + eps)
    den = float(var) + eps
    return eps / den if den != 0.0 else float("nan")


def deletion_cost(share):
    """Relative length lost when the dead-plane part is deleted: ``1 - sqrt(1 - share^2)``, computed as
    ``s^2 / (1 + sqrt(1 - s^2))``.  Arrays outside [0, 1] give nan, a python float there raises ValueError."""
    if isinstance(share, Tensor):
        s2 = share * share
        return s2 / (1.0 + torch.sqrt(1.0 - s2))
    if isinstance(share, np.ndarray):
        s2 = share * share
        with np.errstate(invalid="ignore"):
            return s2 / (1.0 + np.sqrt(1.0 - s2))
    s = float(share)
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"share must be in [0, 1] (a ratio of lengths), got {share!r}")
    s2 = s * s
    return s2 / (1.0 + math.sqrt(1.0 - s2))


def jacobian(x: Tensor, eps: float, kind: NormKind = "layer", weight: Tensor | None = None) -> Tensor:
    """Closed-form ``J[..., i, j] = dy_i / dx_j`` of each row, shape (..., d, d), in ``x``'s dtype; ``g`` is
    ``weight`` (shape (d,)) or 1."""
    d = _check_x(x)
    _check_weight(weight, d)
    st = normalise(x, eps, kind)
    xhat = st.xhat
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    a = eye - xhat.unsqueeze(-1) * xhat.unsqueeze(-2) / d
    if kind == "layer":
        a = a - 1.0 / d
    a = a / st.sigma.unsqueeze(-1).unsqueeze(-1)
    if weight is not None:
        a = weight.to(a.dtype).unsqueeze(-1) * a
    return a


def singular_values(x: Tensor, eps: float, kind: NormKind = "layer", weight: Tensor | None = None) -> Tensor:
    """Singular values of ``jacobian(x, eps, kind, weight)`` per row, shape (..., d), descending (half and
    bfloat16 in float32).  Without ``weight`` the closed form: layer ``d-2`` copies of ``1/sigma``, then
    ``eps/((v+eps) sigma)``, then 0; rms ``d-1`` copies of ``1/r``, then ``eps/((ms+eps) r)``."""
    d = _check_x(x)
    _check_weight(weight, d)
    eps = _check_eps(eps)
    k = dead_dim(kind)
    dt = _work_dtype(x.dtype) if weight is None else _work_dtype(x.dtype, weight.dtype)
    xw = x.to(dt)
    if weight is not None:
        return torch.linalg.svdvals(jacobian(xw, eps, kind, weight.to(dt)))
    st = normalise(xw, eps, kind)
    inv = 1.0 / st.sigma
    if k == 2 and d < 2:  # d = 1 LayerNorm: the output is constant, J = 0
        return torch.zeros_like(xw)
    lead = inv.shape
    parts = [inv.unsqueeze(-1).expand(*lead, d - k), (eps / (st.var + eps) * inv).unsqueeze(-1)]
    if k == 2:
        parts.append(torch.zeros(*lead, 1, dtype=dt, device=x.device))
    return torch.cat(parts, dim=-1)


def _unit(v: Tensor) -> Tensor:
    """``v / |v|`` along the last dim, scaled first so huge or tiny rows do not over/underflow."""
    a = v.abs().amax(dim=-1, keepdim=True)
    v = v / torch.where(a > 0, a, torch.ones_like(a))
    return v / torch.linalg.vector_norm(v, dim=-1, keepdim=True)


def dead_basis(x: Tensor, eps: float, kind: NormKind = "layer") -> Tensor:
    """Orthonormal basis of each row's dead subspace, shape (..., d, k), in ``x``'s dtype: layer
    ``[1/sqrt(d), xhat/|xhat|]``, rms ``[x/|x|]`` (``eps`` is only validated).  Constant (layer) or zero
    (rms) rows give a non-finite column."""
    d = _check_x(x)
    _check_eps(eps)
    k = dead_dim(kind)
    if k == 1:
        return _unit(x).unsqueeze(-1)
    xc = x - x.mean(dim=-1, keepdim=True)
    u1 = torch.full_like(x, 1.0 / math.sqrt(d))
    return torch.stack([u1, _unit(xc)], dim=-1)


def dead_plane_share(x: Tensor, grad_output: Tensor, kind: NormKind = "layer",
                     weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(share, valid)`` of shape ``x.shape[:-1]``: ``share = |P w| / |w|`` in [0, 1] of
    ``w = weight * grad_output``, from per-row reductions, in the promoted dtype (float32 for half/bfloat16).

    ``valid`` is False (and ``share`` 0) on rows with a non-finite ``x`` or ``w``, ``w == 0``, or an undefined
    dead direction (a constant row for layer, a zero row for rms).  Raises ValueError on shapes only,
    including ``d <= k`` (the dead subspace is the whole space)."""
    d = _check_x(x)
    _check_x(grad_output, "grad_output")
    if grad_output.shape != x.shape:
        raise ValueError(f"grad_output must have the shape of x, got {tuple(grad_output.shape)} "
                         f"and {tuple(x.shape)}")
    _check_weight(weight, d)
    k = dead_dim(kind)
    if d <= k:
        raise ValueError(f"dead_plane_share needs width d > {k} for kind={kind!r} (otherwise the dead "
                         f"subspace is the whole space and the share is trivially 1), got d={d}")
    dt = _work_dtype(x.dtype, grad_output.dtype, *([] if weight is None else [weight.dtype]))
    xw = x.detach().to(dt)
    w = grad_output.detach().to(dt)
    if weight is not None:
        w = weight.detach().to(dt) * w
    finite = torch.isfinite(xw).all(dim=-1) & torch.isfinite(w).all(dim=-1)

    if k == 2:
        # a second pass removes the rounding of the first mean: xc is orthogonal to 1 to rounding
        xc = xw - xw.mean(dim=-1, keepdim=True)
        xc = xc - xc.mean(dim=-1, keepdim=True)
        defined = xw.amax(dim=-1) > xw.amin(dim=-1)  # non-constant row
    else:
        xc = xw
        defined = torch.ones(xw.shape[:-1], dtype=torch.bool, device=xw.device)
    # rows scaled to max-abs 1 (the share does not change) keep squares of tiny gradients representable
    ax = xc.abs().amax(dim=-1, keepdim=True)
    aw = w.abs().amax(dim=-1, keepdim=True)
    xc = xc / torch.where(ax > 0, ax, torch.ones_like(ax))
    ws = w / torch.where(aw > 0, aw, torch.ones_like(aw))
    ww = (ws * ws).sum(dim=-1)
    xx = (xc * xc).sum(dim=-1)
    wx = (ws * xc).sum(dim=-1)
    one = torch.ones_like(ww)
    share2 = wx * wx / torch.where(xx > 0, xx, one)
    if k == 2:
        sw = ws.sum(dim=-1)
        share2 = share2 + sw * sw / d
    share2 = share2 / torch.where(ww > 0, ww, one)
    valid = finite & defined & (aw.squeeze(-1) > 0) & (xx > 0) & torch.isfinite(share2)
    share = torch.sqrt(share2.clamp(0.0, 1.0))
    share = torch.where(valid, share, torch.zeros_like(share))
    return share, valid
