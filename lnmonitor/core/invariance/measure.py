"""Final-norm invariance (docs/design.md), in plain torch: no Lightning.

The final norm has no residual after it, so with ``h`` its input the loss is invariant
to ``h + c 1`` exactly and to ``a h`` (a > 0) up to ``eps/v``.  :func:`final_norm_invariance`
checks this on one batch by transforming the final norm's input inside the forward:

* cases (:data:`CASES`): ``shift_5`` (h + 5), ``shift_1000`` (h + 1000), ``scale_3`` (3h),
  ``scale_3_shift_5`` (3h + 5) and the control ``axis_5`` (h + 5 e_0, coordinate 0 only,
  which must move the loss);
* the scale sweep over ``a`` in :data:`SWEEP_SCALES`: per-``a`` *signed* delta-loss and
  median ``eps/v`` at that scale (``eps / (a^2 v)``), a least-squares fit of ``log|dloss|``
  against ``log(eps/v)`` over the points with ``1e-5 < eps/v < 10`` whose delta-loss has
  one sign, at least three of them
  (:func:`~lnmonitor.core.invariance.sweep.fit_sweep`; ``slope``, ``constant =
  exp(intercept)``, ``fit_note`` saying how or why not), and the points with
  ``eps/v <= 1e-5`` whose loss moved flagged as float32 rounding, not eps (only when the
  unscaled input's ``eps/v`` is below 1e-5 too: otherwise a large ``a`` moves the loss by
  removing the model's own eps effect, which is real).

How the input is transformed.  A forward hook on the final norm takes its input ``h``,
applies the transform in float64 and replaces the norm's output by the norm evaluated
there in float64 from its checked form (:meth:`lnmonitor.core.norms.find.NormInfo.affine` of ``xhat``:
``gain * xhat + bias``, which the norm reproduced in float64 before it was measured), cast
back to the output's dtype; the untransformed baseline goes through the same float64
path.  The delta-loss is therefore what the *transformation* does to the loss through
the rest of the model at the model's own precision, without the float32 rounding of
``h + 1000`` or of the norm's own arithmetic (which would otherwise swamp the eps effect
at small ``sigma``).  So the shift cases are zero to the last bit in float32 for a
LayerNorm, and non-zero for a norm that is not shift-invariant (an RMSNorm; a
hand-written "LayerNorm" that forgets to centre is found to be one).  Only the final norm
sees the transformed input (the hook replaces its output): a path that reads ``h`` around
the final norm is not transformed.  No copy of the module is made, so a sharded model
(FSDP2) is probed the same way.

Only the first pass runs the model whole: the others replay what finished before the
final norm was called (the embeddings, the blocks, an encoder), the same in every pass,
and run from the final norm on (:class:`lnmonitor.core.invariance.replay.PrefixReplay`), after one
replayed pass has given the first pass's loss and logits to the bit (else they run whole;
a sharded model's passes always do).  A run costs about one forward pass and, per case
and scale, the head and the loss.

The norm-output residual ``|xhat(T h) - xhat(h)| / |xhat(h)|`` is computed per row in
float64 on ``xhat`` (before the gain and bias), so for ``T h = a h + c 1`` it equals
``|a sigma / sigma_a - 1|`` with ``sigma_a = sqrt(a^2 v + eps)`` exactly (RMSNorm: ``v``
is the mean square, and shifts are not an invariance).  Reported as the median over
rows, with the maximum alongside.

The module's train/eval flags and the torch RNG state (CPU and the batch's CUDA
device) are restored afterwards; everything runs under ``torch.no_grad()``, eagerly
(``torch.compile``-d code would not see the hook) and invisible to the norm taps of a
``LayerNormMonitor`` measuring the same step.

Is the norm final?  :mod:`lnmonitor.core.invariance.final_norm` finds it and checks it; the result
types are in :mod:`lnmonitor.core.invariance.results`, the loss contract in
:mod:`lnmonitor.core.invariance.loss_contract`, the sweep's fit in :mod:`lnmonitor.core.invariance.sweep`, and
the stateful probe the monitors drive in :mod:`lnmonitor.core.invariance.probe`.
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
    module: nn.Module,
    batch,
    final_norm: nn.Module | str | None = None,
    *,
    loss_fn: LossFn | None = None,
    cases: Sequence[str] = CASES,
    scales: Sequence[float] = SWEEP_SCALES,
    autocast: Callable[[], object] | None = None,
    norms: Sequence[NormInfo] | None = None,
) -> InvarianceResult:
    """Run the invariance cases and the scale sweep of the final norm on ``batch``.

    ``final_norm``: the module or its qualified name; ``None`` finds the last norm to run
    (:func:`find_final_norm`).  ``loss_fn(module, batch)`` returns the loss or
    ``(logits, loss)``; the default calls ``module(*batch)`` (see :func:`default_loss`).
    ``autocast``: an optional context-manager factory entered around every forward (e.g.
    a Lightning precision plugin's ``forward_context``).  ``norms``: the model's norms, when
    already found (they are not searched again).  Returns plain dataclasses.
    """
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

    # the transform of the current pass, the first pass's input and eps, and the row statistics
    # of the transformed input at the current pass's first call of the norm
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

    # the passes after the first replay what ran before the final norm (a sharded model's
    # forward is a collective, which every rank must run alike: it runs whole)
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
        # per case: the loss, max |logits - base logits| and the norm-output residual per row
        results: dict[str, tuple] = {}
        for c in cases:
            with passes():
                loss, logits, stats = run(CASE_TRANSFORMS[c])
            dlogit = None
            if logits is not None and base_logits is not None and logits.shape == base_logits.shape:
                dlogit = float((logits.float() - base_logits.float()).abs().max())
            resid = torch.linalg.vector_norm(stats.xhat.reshape(-1, d) - xhat, dim=-1) / xnorm
            results[c] = (loss, dlogit, resid[torch.isfinite(resid)])
        sweep_losses = {}
        for a in scales:
            if a == 1.0:
                sweep_losses[a] = base_loss
                continue
            with passes():
                sweep_losses[a] = run((a, 0.0, False))[0]

    eps = float(state["eps"])
    v = base.var.reshape(-1)
    base_value = float(base_loss)

    res = InvarianceResult(name, info.kind, eps, int(xhat.shape[0]), base_value)
    for c in cases:
        loss, dlogit, resid = results[c]
        res.cases[c] = _case(c, float(loss) - base_value, dlogit, resid, v, eps, info.kind)
    sweep = _sweep([(a, float(sweep_losses[a]) - base_value) for a in scales], v, eps)
    res.slope, res.constant, res.fit_note = fit_sweep(sweep)
    res.sweep = fitted(sweep)
    return res


def _case(case: str, dloss: float, dlogit: float | None, resid: Tensor, v: Tensor, eps: float,
          kind: str) -> CaseResult:
    """One case's result from its delta-loss, max |delta-logit| and per-row output residuals;
    the expected residual ``|a sigma / sigma_a - 1|`` where the transform is ``a h + c 1`` and
    the norm is shift-invariant (a LayerNorm) or not shifted."""
    scale, shift, axis = CASE_TRANSFORMS[case]
    expected = None
    if not axis and (shift == 0.0 or kind == "layer"):
        sigma = torch.sqrt(v + eps)
        sigma_a = torch.sqrt(scale * scale * v + eps)
        expected = float(torch.nanmedian((scale * sigma / sigma_a - 1.0).abs()))
    return CaseResult(
        case=case, scale=scale, shift=shift, dloss=dloss, max_dlogit=dlogit,
        out_residual=float(resid.median()) if resid.numel() else math.nan,
        out_residual_max=float(resid.max()) if resid.numel() else math.nan,
        expected_residual=expected,
    )


def _sweep(dlosses: Sequence[tuple[float, float]], v: Tensor, eps: float) -> list[SweepPoint]:
    """The sweep's points from ``(scale, delta-loss)`` pairs and the rows' variances ``v``."""
    v_med = float(torch.nanmedian(v[v > 0])) if bool((v > 0).any()) else math.nan
    points = []
    for a, dl in dlosses:
        ratio = eps / (a * a * v_med) if v_med > 0 else math.nan
        moved = dl != 0.0 and math.isfinite(dl)
        in_window = moved and FIT_RANGE[0] < ratio < FIT_RANGE[1]
        # Rounding only when eps can explain nothing: tiny eps/v at this scale *and* at
        # a = 1 (else a large a moves the loss by removing the model's own eps effect).
        rounding = moved and max(ratio, eps / v_med) <= ROUNDING_BELOW
        points.append(SweepPoint(a, dl, ratio, in_window, bool(rounding)))
    return points
