"""Final-norm invariance (docs/design.md), in plain torch.

With ``h`` the final norm's input, the loss is invariant to ``h + c 1`` exactly and to ``a h`` up to
``eps/v``.  :func:`final_norm_invariance` checks this on one batch: the cases of :data:`CASES` (``axis_5`` is
the control that must move the loss) and the scale sweep over :data:`SWEEP_SCALES`.  A forward hook replaces
the final norm's output by its checked float64 form (:meth:`~lnmonitor.core.norms.find.NormInfo.affine` of
``xhat``) at the transformed input; the baseline takes the same path, so a delta-loss is the transformation's
effect alone.  The passes after the first replay what ran before the final norm
(:class:`~lnmonitor.core.invariance.replay.PrefixReplay`) once a replayed pass gives the first one's loss and
logits to the bit; a sharded model's run whole.  The module's train/eval flags and the RNG state are restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors
from lnmonitor.core.hooks import Hooks, restored
from lnmonitor.core.invariance.final_norm import find_final_norm, named_norm
from lnmonitor.core.invariance.loss_contract import LossFn, default_loss, split_output
from lnmonitor.core.invariance.replay import PrefixReplay
from lnmonitor.core.invariance.results import (
    CASE_TRANSFORMS,
    CASES,
    SWEEP_SCALES,
    CaseResult,
    InvarianceResult,
    SweepPoint,
)
from lnmonitor.core.invariance.sweep import FIT_RANGE, ROUNDING_BELOW, fit_sweep, fitted
from lnmonitor.core.maths.geometry import normalise
from lnmonitor.core.norms.find import NormInfo, find_norms
from lnmonitor.core.wrappers import sharded

__all__ = ["final_norm_invariance"]


def _transform(h: Tensor, scale: float, shift: float, axis: bool) -> Tensor:
    out = h * scale if scale != 1.0 else h.clone()
    if shift:
        if axis:
            out[..., 0] += shift
        else:
            out += shift
    return out


def final_norm_invariance(
    module: nn.Module, batch, final_norm: nn.Module | str | None = None, *, loss_fn: LossFn | None = None,
    cases: Sequence[str] = CASES, scales: Sequence[float] = SWEEP_SCALES,
    autocast: Callable[[], object] | None = None, norms: Sequence[NormInfo] | None = None,
) -> InvarianceResult:
    """Run the invariance cases and the scale sweep of the final norm on ``batch``. ``final_norm``: the module
    or its qualified name; None finds the last norm to run
    (:func:`~lnmonitor.core.invariance.final_norm.find_final_norm`). ``loss_fn(module, batch)`` returns the
    loss or ``(logits, loss)`` (default :func:`~lnmonitor.core.invariance.loss_contract.default_loss`).
    ``autocast``: a context-manager factory entered around every forward. ``norms``: the model's norms, when
    already found."""
    unknown = [c for c in cases if c not in CASE_TRANSFORMS]
    if unknown:
        raise ValueError(f"unknown invariance cases {unknown}; choose from {list(CASES)}")
    scales = [float(a) for a in scales]
    if any(not (math.isfinite(a) and a > 0) for a in scales):
        raise ValueError(f"sweep scales must be finite and > 0, got {scales}")
    loss_fn = loss_fn or default_loss
    norms = find_norms(module) if norms is None else list(norms)
    if final_norm is None:
        final_norm = find_final_norm(module, batch, loss_fn, norms)
    info = named_norm(norms, final_norm)
    norm, name = info.module, info.name
    ctx = autocast or nullcontext

    # the current pass's transform, the first pass's input and eps, the stats at the pass's first norm call
    state: dict = {"t": None, "h": None, "eps": None, "stats": None}

    def hook(mod, args, output):
        h = dtensors.whole(args[0].detach())  # tensor parallel: every rank the whole input
        if state["h"] is None:
            state["h"], state["eps"] = h, info.eps(h.dtype)
        h64 = h.to(torch.float64)
        if state["t"] is not None:
            h64 = _transform(h64, *state["t"])
        with torch.autocast(h.device.type, enabled=False):
            stats = normalise(h64, info.eps(h.dtype), info.kind)
            out = info.affine(stats.xhat)
        if state["stats"] is None:
            state["stats"] = stats
        return dtensors.laid_out(out.to(output.dtype), output, args[0])

    def run(t):
        """One pass: its loss, logits and the final norm's row statistics."""
        state["t"], state["stats"] = t, None
        with ctx():
            loss, logits = split_output(loss_fn(module, batch))
        # a tensor-parallel head's logits and loss (loss_parallel) whole on every rank
        loss, logits = dtensors.whole(loss.detach()), dtensors.whole(logits)
        return loss.float(), None if logits is None else logits.detach(), state["stats"]

    # a sharded model's forward is a collective every rank must run alike: its passes run whole
    replay = PrefixReplay(module, norm) if (cases or scales) and not sharded(module) else None
    with Hooks() as hooks, restored(module, batch), torch.no_grad():
        hooks.forward(norm, hook)
        with replay.recording() if replay else nullcontext():
            base_loss, base_logits, base = run(None)
        if state["h"] is None:
            raise ValueError(f"the final norm {name!r} did not run in the forward")
        fast = replay is not None and replay.faithful(lambda: run(None)[:2], (base_loss, base_logits))
        passes = replay.replaying if fast else nullcontext
        d = base.xhat.shape[-1]
        xhat = base.xhat.reshape(-1, d)
        xnorm = torch.linalg.vector_norm(xhat, dim=-1)
        eps, v, base_value = float(state["eps"]), base.var.reshape(-1), float(base_loss)
        res = InvarianceResult(name, info.kind, eps, int(xhat.shape[0]), base_value)
        for c in cases:
            with passes():
                loss, logits, stats = run(CASE_TRANSFORMS[c])
            dlogit = None
            if logits is not None and base_logits is not None and logits.shape == base_logits.shape:
                dlogit = float((logits.float() - base_logits.float()).abs().max())
            resid = torch.linalg.vector_norm(stats.xhat.reshape(-1, d) - xhat, dim=-1) / xnorm
            res.cases[c] = _case(c, float(loss) - base_value, dlogit, resid[torch.isfinite(resid)], v, eps,
                                 info.kind)
        dlosses = []
        for a in scales:
            if a == 1.0:
                loss = base_loss
            else:
                with passes():
                    loss = run((a, 0.0, False))[0]
            dlosses.append((a, float(loss) - base_value))
    sweep = _sweep(dlosses, v, eps)
    res.slope, res.constant, res.fit_note = fit_sweep(sweep)
    res.sweep = fitted(sweep)
    return res


def _case(case: str, dloss: float, dlogit: float | None, resid: Tensor, v: Tensor, eps: float,
          kind: str) -> CaseResult:
    """One case's result; the expected residual ``|a sigma / sigma_a - 1|`` where the transform is
    ``a h + c 1`` and the norm is shift-invariant (a LayerNorm) or not shifted."""
    scale, shift, axis = CASE_TRANSFORMS[case]
    expected = None
    if not axis and (shift == 0.0 or kind == "layer"):
        sigma = torch.sqrt(v + eps)
        sigma_a = torch.sqrt(scale * scale * v + eps)
        expected = float(torch.nanmedian((scale * sigma / sigma_a - 1.0).abs()))
    return CaseResult(case=case, scale=scale, shift=shift, dloss=dloss, max_dlogit=dlogit,
                      out_residual=float(resid.median()) if resid.numel() else math.nan,
                      out_residual_max=float(resid.max()) if resid.numel() else math.nan,
                      expected_residual=expected)


def _sweep(dlosses: Sequence[tuple[float, float]], v: Tensor, eps: float) -> list[SweepPoint]:
    """The sweep's points from ``(scale, delta-loss)`` pairs and the rows' variances ``v``."""
    v_med = float(torch.nanmedian(v[v > 0])) if bool((v > 0).any()) else math.nan
    points = []
    for a, dl in dlosses:
        ratio = eps / (a * a * v_med) if v_med > 0 else math.nan
        moved = dl != 0.0 and math.isfinite(dl)
        in_window = moved and FIT_RANGE[0] < ratio < FIT_RANGE[1]
        # rounding only when eps explains nothing here *and* at a = 1 (else a large a removes the model's eps)
        rounding = moved and max(ratio, eps / v_med) <= ROUNDING_BELOW
        points.append(SweepPoint(a, dl, ratio, in_window, bool(rounding)))
    return points
