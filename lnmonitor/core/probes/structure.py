"""Structural probes, why LayerNorm does what the monitors show (docs/design.md); pure torch.

Each probe returns a frozen dataclass of python numbers.  :func:`probe_norm_jacobian`: one norm at one real
input row, the closed-form Jacobian against autograd in float64, its numerical rank at the module's eps and at
eps = 0, and the *gain spread* (largest over smallest nonzero singular value of ``diag(g) (1/sigma) P``, ``P``
the projector off the dead subspace).  :func:`probe_block_rank`: the Jacobian of a residual block at one
position with respect to that position's hidden state, and of the branch through its first norm.

Ranks count the singular values above a tolerance every result states (``rank_rule``): numpy's
``matrix_rank`` rule ``s_max * d * eps_float64`` by default, ``rtol * s_max`` with ``rtol``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lnmonitor.core.float64 import float64_forward
from lnmonitor.core.kinds import NormKind
from lnmonitor.core.maths import geometry
from lnmonitor.core.norms.find import NormInfo, describe_norm
from lnmonitor.core.probes.blocks import Branch, resolve_branch

__all__ = ["BlockRankProbe", "NormJacobianProbe", "numerical_rank", "probe_block_rank", "probe_norm_jacobian",
           "rank_rule"]

_F64 = torch.float64
_EPS64 = float(torch.finfo(_F64).eps)


def rank_rule(rtol: float | None, d: int) -> str:
    """The tolerance rule, in words, that :func:`numerical_rank` applies."""
    if rtol is None:
        return f"sv > s_max * d * eps_float64 = s_max * {d * _EPS64:.2e} (numpy matrix_rank default)"
    return f"sv > {rtol:g} * s_max"


def numerical_rank(sv: Tensor, rtol: float | None = None) -> tuple[int, float]:
    """``(rank, tol)`` of a descending spectrum ``sv`` of a square (d, d) matrix (see :func:`rank_rule`)."""
    d = sv.shape[-1]
    s_max = float(sv.max()) if d else 0.0
    tol = s_max * (d * _EPS64 if rtol is None else rtol)
    return int((sv > tol).sum()), tol


def _check_rtol(rtol) -> float | None:
    if rtol is None:
        return None
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not 0.0 < rtol < 1.0:
        raise ValueError(f"rtol must be None (numpy's rule) or a float in (0, 1), got {rtol!r}")
    return float(rtol)


@dataclass(frozen=True)
class NormJacobianProbe:
    """A norm's Jacobian at one real input row, all in float64. ``max_abs_error``: max |closed form -
    autograd| over the entries, next to ``max_abs_entry`` (max |J|). ``rank`` at the module's ``eps`` (d-1 for
    LayerNorm: the scale direction passes ``transmission = eps/(v+eps)``) and ``rank_eps0`` at eps = 0 (d-2).
    ``gain_spread = gain_sv_max / gain_sv_min`` over the d-k nonzero singular values of ``diag(g) (1/sigma)
    P`` (1 without a gain; inf if a gain entry is 0). ``singular_values``/``singular_values_eps0``: the
    Jacobian's spectrum, descending, in 1/(units of x)."""

    name: str
    kind: NormKind
    width: int
    eps: float
    max_abs_error: float
    max_abs_entry: float
    rank: int
    rank_eps0: int
    rank_rule: str
    inv_sigma: float
    transmission: float
    gain_spread: float
    gain_sv_max: float
    gain_sv_min: float
    singular_values: tuple[float, ...]
    singular_values_eps0: tuple[float, ...]


def _norm_info(norm, kind: NormKind | None, eps: float | None):
    """``(module, kind, eps, eps64, weight)`` from a ``NormInfo`` or a bare module: the eps the norm applies
    to float32 and to float64 input (they differ for an eps of None, the dtype's machine epsilon)."""
    if not isinstance(norm, NormInfo):
        info = describe_norm(norm)
        if info is None:
            if kind is None or eps is None:
                raise ValueError(f"{type(norm).__name__} is not a normalisation layer lnmonitor recognises: "
                                 "pass kind='layer' or 'rms' and eps=..., or register it with "
                                 "lnmonitor.register_norm")
            weight = getattr(norm, "weight", None)
            return norm, kind, float(eps), float(eps), weight if isinstance(weight, Tensor) else None
        norm = info
    if eps is not None:
        return norm.module, kind or norm.kind, float(eps), float(eps), norm.gain()
    return norm.module, kind or norm.kind, norm.eps(torch.float32), norm.eps(torch.float64), norm.gain()


def probe_norm_jacobian(
    norm, x: Tensor, *, name: str = "", kind: NormKind | None = None, eps: float | None = None,
    rtol: float | None = None,
) -> NormJacobianProbe:
    """Check the closed-form Jacobian of ``norm`` at the row ``x`` (shape (d,)) against autograd. ``norm``: a
    ``NormInfo`` or a norm module (``kind``/``eps`` read from it when recognised). The module's float64
    forward is differentiated; the model is not touched. The rank and spectrum use the eps the module applies
    to float32 input, the error the eps it applies to float64 input."""
    rtol = _check_rtol(rtol)
    if hasattr(norm, "name") and not name:
        name = norm.name
    module, kind, eps, eps64, weight = _norm_info(norm, kind, eps)
    k = geometry.dead_dim(kind)  # validates kind
    shape = getattr(module, "normalized_shape", None)
    if shape is not None and not isinstance(shape, int) and len(tuple(shape)) > 1:
        raise ValueError(f"norm {name!r} normalises over {tuple(shape)}: the probes handle norms over the "
                         "last dimension only")
    with torch.inference_mode(False), torch.enable_grad():
        row = x.detach().reshape(-1).to("cpu", _F64).clone()
        d = row.shape[0]
        g = None if weight is None else weight.detach().reshape(-1).to("cpu", _F64).clone()
        if g is not None and g.shape[0] != d:
            raise ValueError(f"norm {name!r}: gain has {g.shape[0]} entries, the row has {d}")
        closed = geometry.jacobian(row, eps, kind, g)
        forward = float64_forward(module)
        device = next((p.device for p in module.parameters()), row.device)
        auto = torch.autograd.functional.jacobian(lambda r: forward(r[None].to(device))[0].cpu(), row)
        error = float((geometry.jacobian(row, eps64, kind, g) - auto).abs().max())
        sv = torch.linalg.svdvals(closed)
        sv0 = torch.linalg.svdvals(geometry.jacobian(row, 0.0, kind, g))
        rank, _ = numerical_rank(sv, rtol)
        rank0, _ = numerical_rank(sv0, rtol)
        st = geometry.normalise(row, eps, kind)
        basis = geometry.dead_basis(row, eps, kind)
        projector = torch.eye(d, dtype=_F64) - basis @ basis.T
        gained = projector / st.sigma if g is None else g[:, None] * projector / st.sigma
        gsv = torch.linalg.svdvals(gained)[: d - k]
    g_max, g_min = float(gsv[0]), float(gsv[-1])
    return NormJacobianProbe(
        name=name, kind=kind, width=d, eps=eps, max_abs_error=error,
        max_abs_entry=float(auto.abs().max()), rank=rank, rank_eps0=rank0,
        rank_rule=rank_rule(rtol, d), inv_sigma=float(1.0 / st.sigma),
        transmission=float(geometry.transmission(st.var, eps)),
        gain_spread=g_max / g_min if g_min > 0 else math.inf, gain_sv_max=g_max, gain_sv_min=g_min,
        singular_values=tuple(float(s) for s in sv), singular_values_eps0=tuple(float(s) for s in sv0),
    )


@dataclass(frozen=True)
class BlockRankProbe:
    """Jacobians at one position ``position`` of a block's input, other positions held fixed. ``block_*``: ``d
    block(h)[position] / d h[position]`` (d x d, float64); ``branch_*``: the same for the branch ``branch``
    (e.g. ``ln1 -> attn``). ``*_rank`` counts singular values above ``*_tol``; ``*_sv_min``/``*_sv_max``: the
    smallest and largest singular values (dimensionless)."""

    name: str
    position: int
    width: int
    branch: str
    rank_rule: str
    block_rank: int
    block_tol: float
    block_sv_min: float
    block_sv_max: float
    branch_rank: int
    branch_tol: float
    branch_sv_min: float
    branch_sv_max: float
    block_singular_values: tuple[float, ...]
    branch_singular_values: tuple[float, ...]


def _position_jacobian(fn: Callable[[Tensor], Tensor], h: Tensor, pos: int) -> Tensor:
    """``d fn(h)[0, pos] / d h[pos]`` (d x d), other positions fixed: the sequence copied d times along the
    batch, copy ``i`` giving output coordinate ``i``, so one backward yields every row."""
    steps, d = h.shape
    leaf = h[pos].expand(d, d).clone().requires_grad_(True)
    before, after = h[:pos].expand(d, pos, d), h[pos + 1:].expand(d, steps - pos - 1, d)
    batch = torch.cat([before, leaf[:, None], after], dim=1)
    out = fn(batch)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(f"block returned {type(out).__name__}; expected a tensor (or a tuple starting with "
                        "one)")
    if out.shape != (d, steps, d):
        raise ValueError(f"the block maps (B, T, d) to {tuple(out.shape)}; expected (B, T, d) back")
    (grad,) = torch.autograd.grad(out[:, pos].diagonal().sum(), leaf)
    return grad


def probe_block_rank(
    block: nn.Module, h: Tensor, norms: Sequence[NormInfo], *, position: int = -1, name: str = "",
    branch: Sequence[str] | Branch | None = None, rtol: float | None = None,
) -> BlockRankProbe:
    """Block and branch Jacobians of ``block`` at ``position`` (negative: from the end) of ``h``, one
    sequence (T, d) or (1, T, d) of the block's real input.  A float64 CPU copy of the block is called as
    ``block(h[None])``; the model is not touched.
    """
    rtol = _check_rtol(rtol)
    if h.ndim == 3 and h.shape[0] == 1:
        h = h[0]
    if h.ndim != 2:
        raise ValueError(f"h must be one sequence, (T, d) or (1, T, d); got {tuple(h.shape)}")
    steps, d = h.shape
    if isinstance(position, bool) or not isinstance(position, int) or not -steps <= position < steps:
        raise ValueError(f"position must be an integer in [-{steps}, {steps}), got {position!r}")
    pos = position % steps
    label, branch_fn = resolve_branch(block, norms, branch)
    with torch.inference_mode(False), torch.enable_grad():
        # a float64 copy of the whole block, since the branch function calls its children
        copy64 = copy.deepcopy(block).to("cpu", _F64).eval()
        for p in copy64.parameters():
            p.requires_grad_(False)
        h64 = h.detach().to("cpu", _F64).clone()
        jb = _position_jacobian(copy64, h64, pos)
        jr = _position_jacobian(lambda x: branch_fn(copy64, x), h64, pos)
        svb, svr = torch.linalg.svdvals(jb), torch.linalg.svdvals(jr)
    rb, tb = numerical_rank(svb, rtol)
    rr, tr = numerical_rank(svr, rtol)
    return BlockRankProbe(
        name=name, position=pos, width=d, branch=label, rank_rule=rank_rule(rtol, d),
        block_rank=rb, block_tol=tb, block_sv_min=float(svb[-1]), block_sv_max=float(svb[0]),
        branch_rank=rr, branch_tol=tr, branch_sv_min=float(svr[-1]), branch_sv_max=float(svr[0]),
        block_singular_values=tuple(float(s) for s in svb),
        branch_singular_values=tuple(float(s) for s in svr),
    )


