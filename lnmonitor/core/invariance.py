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
  one sign, at least three of them (:func:`fit_sweep`; ``slope``, ``constant =
  exp(intercept)``, ``fit_note`` saying how or why not), and the points with
  ``eps/v <= 1e-5`` whose loss moved flagged as float32 rounding, not eps (only when the
  unscaled input's ``eps/v`` is below 1e-5 too: otherwise a large ``a`` moves the loss by
  removing the model's own eps effect, which is real).

How the input is transformed.  A forward hook on the final norm takes its input ``h``,
applies the transform in float64 and replaces the norm's output by the norm evaluated
there in float64 from its checked form (:meth:`lnmonitor.core.norms.NormInfo.reference`:
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
and run from the final norm on (:class:`lnmonitor.core.replay.PrefixReplay`), after one
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

Is the norm final?  The cases transform only what the norm sees, so they show the loss's
invariance only when the norm's input reaches the loss through the norm alone.  For a
model without a final norm (the head reads the residual stream), the last norm to run
is a block's norm whose input also flows on through the residual: the loss is not
invariant, yet the cases would read zero.  :func:`final_norm_bypass` measures the share
of the loss gradient at the norm's input that goes around the norm (0 for a true
final norm); the monitor checks it once and refuses to report otherwise.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors
from lnmonitor.core.geometry import row_stats
from lnmonitor.core.hooks import Hooks, eager, eval_mode, sharded, unmeasured
from lnmonitor.core.kinds import NormKind
from lnmonitor.core.metric_names import INVARIANCE, INVARIANCE_CASES, finite_metrics
from lnmonitor.core.norms import NormInfo, find_norms
from lnmonitor.core.replay import PrefixReplay
from lnmonitor.core.sweep import FIT_RANGE, ROUNDING_BELOW

__all__ = [
    "CASES",
    "PROBE_WINDOWS",
    "CaseResult",
    "FIT_RANGE",
    "InvarianceProbe",
    "InvarianceResult",
    "NonFiniteLoss",
    "NotAFinalNorm",
    "SWEEP_SCALES",
    "SweepPoint",
    "default_loss",
    "final_norm_bypass",
    "final_norm_invariance",
    "find_final_norm",
    "fit_sweep",
    "restored",
    "split_output",
]

CASES = INVARIANCE_CASES
# The probe rows, one definition for every tool (the monitor's default probe_size, analyze,
# eps-compare): the first PROBE_WINDOWS samples of the held-out data.  Across disjoint sets
# of windows spanning the held-out text, the spread of a real delta-loss (scale 3 at
# eps = 0.1) falls as 1/sqrt(windows): 0.37, 0.18, 0.08 of its mean at 8, 32, 128
# (benchmarks/probe_rows.py).
PROBE_WINDOWS = 64
SWEEP_SCALES = (1e3, 1e1, 1.0, 1e-1, 1e-2, 3e-3, 1e-3, 1e-4)

# (scale a, shift c, single axis?) of each case: T h = a h + c (1 or e_0)
_CASE_TRANSFORMS = {
    "shift_5": (1.0, 5.0, False),
    "shift_1000": (1.0, 1000.0, False),
    "scale_3": (3.0, 0.0, False),
    "scale_3_shift_5": (3.0, 5.0, False),
    "axis_5": (1.0, 5.0, True),
}

LossFn = Callable[[nn.Module, object], object]


@dataclass
class CaseResult:
    """One transformation of the final norm's input."""

    case: str
    scale: float
    shift: float
    dloss: float  # loss(T h) - loss(h), nats
    max_dlogit: float | None  # max |logits(T h) - logits(h)|; None without logits
    out_residual: float  # median over rows of |xhat(T h) - xhat(h)| / |xhat(h)| (float64)
    out_residual_max: float
    expected_residual: float | None  # median of |a sigma/sigma_a - 1|; None when not a*h + c*1


@dataclass
class SweepPoint:
    """One scale ``a`` of the sweep."""

    scale: float
    dloss: float  # signed: loss(a h) - loss(h), nats
    eps_over_var: float  # median over rows of eps / (a^2 v)
    in_fit: bool  # in the window and used by the fit (see fit_sweep)
    rounding: bool  # eps/v <= 1e-5 here and at a = 1, yet the loss moved: float32 rounding


@dataclass
class InvarianceResult:
    """Everything :func:`final_norm_invariance` measured."""

    final_norm: str
    kind: NormKind
    eps: float
    rows: int
    base_loss: float
    cases: dict[str, CaseResult] = field(default_factory=dict)
    sweep: list[SweepPoint] = field(default_factory=list)
    slope: float = math.nan
    constant: float = math.nan
    fit_note: str = ""  # how the sweep was fitted, or why it was not (fit_sweep)

    @property
    def rounding_scales(self) -> list[float]:
        return [p.scale for p in self.sweep if p.rounding]

    def metrics(self, prefix: str = INVARIANCE) -> dict[str, float]:
        """The logged metric names and values (cases without logits omit max_dlogit; a
        delta-loss of exactly zero has no log10 and gets none, which the caller drops)."""
        out: dict[str, float] = {}
        for name, c in self.cases.items():
            out[f"{prefix}/{name}/dloss"] = c.dloss
            out[f"{prefix}/{name}/log10_abs_dloss"] = math.log10(abs(c.dloss)) if c.dloss else math.nan
            if c.max_dlogit is not None:
                out[f"{prefix}/{name}/max_dlogit"] = c.max_dlogit
            out[f"{prefix}/{name}/out_residual"] = c.out_residual
        if self.sweep:
            out[f"{prefix}/scale_slope"] = self.slope
            out[f"{prefix}/scale_constant"] = self.constant
            out[f"{prefix}/scale_rounding_points"] = float(len(self.rounding_scales))
        return out


def split_output(out) -> tuple[Tensor, Tensor | None]:
    """``(loss, logits)`` from a forward output: a scalar loss, ``(logits, loss)``, or a
    mapping with ``"loss"`` (and optionally ``"logits"``)."""
    if isinstance(out, Tensor):
        if out.numel() != 1:
            raise ValueError(
                f"the forward returned a tensor of shape {tuple(out.shape)}, not a scalar loss: "
                "pass loss_fn(module, batch) returning the loss or (logits, loss)"
            )
        return out, None
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"], out.get("logits")
    if isinstance(out, (tuple, list)) and len(out) == 2:
        logits, loss = out
        if isinstance(loss, Tensor) and loss.numel() == 1:
            return loss, logits if isinstance(logits, Tensor) else None
    raise ValueError(
        f"cannot find a loss in a forward output of type {type(out).__name__}: the default "
        "expects module(x, y) to return a loss or (logits, loss); pass loss_fn(module, batch)"
    )


def default_loss(module: nn.Module, batch):
    """``module(*batch)`` for a tuple/list batch (``module(**batch)`` for any mapping, a
    ``BatchEncoding`` included, else ``module(batch)``): a loss or ``(logits, loss)`` as
    :func:`split_output` reads it."""
    if isinstance(batch, Mapping):
        out = module(**batch)
    elif isinstance(batch, (tuple, list)):
        out = module(*batch)
    else:
        out = module(batch)
    return out


def _named(norms: Sequence[NormInfo], final_norm: nn.Module | str) -> NormInfo:
    """The norm of ``norms`` that ``final_norm`` (a qualified name or the module) names."""
    for info in norms:
        if info.name == final_norm or info.module is final_norm:
            return info
    what = final_norm if isinstance(final_norm, str) else type(final_norm).__name__
    found = ", ".join(n.name for n in norms)
    raise ValueError(f"{what!r} is not a normalisation layer of the model (found: {found})")


def find_final_norm(
    module: nn.Module, batch, loss_fn: LossFn | None = None, norms: Sequence[NormInfo] | None = None
) -> str:
    """Qualified name of the last normalisation layer to run in ``module``'s forward on
    ``batch`` (found with temporary forward hooks, under ``no_grad``, in eval mode).
    ``norms``: the norms to consider (default :func:`lnmonitor.core.norms.find_norms`)."""
    norms = find_norms(module) if norms is None else list(norms)
    if not norms:
        raise ValueError("the module has no normalisation layer (see lnmonitor.core.norms.find_norms)")
    order: list[str] = []
    with Hooks() as hooks, restored(module, batch), torch.no_grad():
        for info in norms:
            hooks.forward(info.module, lambda m, a, o, n=info.name: order.append(n))
        (loss_fn or default_loss)(module, batch)
    if not order:
        raise ValueError(
            "no normalisation layer ran in the forward: name the final norm explicitly"
        )
    return order[-1]


@contextlib.contextmanager
def restored(module: nn.Module, batch) -> Iterator[None]:
    """Eval mode, eager code and no tap for the duration; then every submodule's train
    flag and the torch RNG state (CPU and the batch's CUDA devices) back as they were.
    Each part is undone even when entering a later one raises."""
    devices = sorted({t.device.index or 0 for t in _tensors(batch) if t.device.type == "cuda"})
    with contextlib.ExitStack() as stack:
        stack.enter_context(eval_mode(module))
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(unmeasured())
        stack.enter_context(eager())
        yield


def _tensors(batch):
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from _tensors(v)


def _grad_ready(batch):
    """The batch with every inference-mode tensor replaced by a normal copy (a probe batch
    taken during validation may be one; autograd cannot save it for the backward)."""
    if isinstance(batch, Tensor):
        return batch.clone() if batch.is_inference() else batch
    if isinstance(batch, Mapping):
        return {k: _grad_ready(v) for k, v in batch.items()}
    if isinstance(batch, list):
        return [_grad_ready(v) for v in batch]
    if isinstance(batch, tuple):
        items = [_grad_ready(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    return batch


def final_norm_bypass(
    module: nn.Module,
    batch,
    final_norm: nn.Module | str,
    *,
    loss_fn: LossFn | None = None,
    autocast: Callable[[], object] | None = None,
) -> float:
    """How much of the loss's dependence on the final norm's input ``h`` goes around the
    norm: ``|dL/dh - J^T dL/dy| / |dL/dh|`` on ``batch`` (``J`` the norm's Jacobian, ``y``
    its output), one forward and two partial backwards with gradient, in eval mode.

    0 when ``h`` reaches the loss only through the norm (a true final norm: the two
    gradients are the same numbers); of order 1 when a residual path carries ``h`` on
    (a model without a final norm, whose last norm is inside a block); 1.0 when the loss
    does not depend on the norm's output at all; nan when it cannot tell (the norm did
    not run on a tensor that needs gradient).  Parameters' ``.grad`` are not touched.
    ``h`` is the tensor the norm's caller passed (before a tensor-parallel input hook makes a
    ``DTensor`` of it, whose gradient would be the norm's alone), and the norms are summed
    over the ranks of a ``DTensor`` input's mesh.
    """
    loss_fn = loss_fn or default_loss
    norm = module.get_submodule(final_norm) if isinstance(final_norm, str) else final_norm
    ctx = autocast or nullcontext
    seen: dict = {}

    def passed(mod, args):
        if "passed" not in seen and args and isinstance(args[0], Tensor):
            seen["passed"] = args[0]

    def hook(mod, args, output):
        if "h" not in seen and args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
            seen["h"], seen["y"] = seen.get("passed", args[0]), output
            seen["input"] = args[0]

    with Hooks() as hooks, torch.inference_mode(False), torch.enable_grad():
        hooks.forward_pre(norm, passed, prepend=True)
        hooks.forward(norm, hook)
        batch = _grad_ready(batch)
        with restored(module, batch):
            with ctx():
                loss, _ = split_output(loss_fn(module, batch))
            h, y = seen.get("h"), seen.get("y")
            if h is None or not (h.requires_grad and loss.requires_grad):
                return math.nan
            if not y.requires_grad:
                return 1.0
            try:
                g_h, g_y = torch.autograd.grad(loss, [h, y], retain_graph=True, allow_unused=True)
                if g_h is None:
                    return math.nan
                if g_y is None:
                    return 1.0
                (through,) = torch.autograd.grad(y, h, g_y, allow_unused=True)
            except RuntimeError:  # a graph autograd cannot differentiate: cannot tell
                return math.nan
    g_h = dtensors.local(g_h.detach()).double()
    through = torch.zeros_like(g_h) if through is None else dtensors.local(through.detach()).double()
    squares = torch.stack((g_h.square().sum(), (g_h - through).square().sum()))
    total, around = dtensors.summed(squares, seen["input"]).sqrt().tolist()
    if not math.isfinite(total):
        return math.nan
    if total == 0.0:
        return 0.0
    return around / total


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
    unknown = [c for c in cases if c not in _CASE_TRANSFORMS]
    if unknown:
        raise ValueError(f"unknown invariance cases {unknown}; choose from {list(CASES)}")
    scales = [float(a) for a in scales]
    if any(not (math.isfinite(a) and a > 0) for a in scales):
        raise ValueError(f"sweep scales must be finite and > 0, got {scales}")
    loss_fn = loss_fn or default_loss
    norms = find_norms(module) if norms is None else list(norms)
    if final_norm is None:
        final_norm = find_final_norm(module, batch, loss_fn, norms)
    info = _named(norms, final_norm)
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
            stats = row_stats(h64, info.eps(h.dtype), info.kind)
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
                loss, logits, stats = run(_CASE_TRANSFORMS[c])
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
        scale, shift, axis = _CASE_TRANSFORMS[c]
        loss, dlogit, resid = results[c]
        expected = None
        if not axis and (shift == 0.0 or info.kind == "layer"):
            sigma = torch.sqrt(v + eps)
            sigma_a = torch.sqrt(scale * scale * v + eps)
            expected = float(torch.nanmedian((scale * sigma / sigma_a - 1.0).abs()))
        res.cases[c] = CaseResult(
            case=c, scale=scale, shift=shift, dloss=float(loss) - base_value, max_dlogit=dlogit,
            out_residual=float(resid.median()) if resid.numel() else math.nan,
            out_residual_max=float(resid.max()) if resid.numel() else math.nan,
            expected_residual=expected,
        )

    v_med = float(torch.nanmedian(v[v > 0])) if bool((v > 0).any()) else math.nan
    for a in scales:
        dl = float(sweep_losses[a]) - base_value
        ratio = eps / (a * a * v_med) if v_med > 0 else math.nan
        moved = dl != 0.0 and math.isfinite(dl)
        in_window = moved and FIT_RANGE[0] < ratio < FIT_RANGE[1]
        # Rounding only when eps can explain nothing: tiny eps/v at this scale *and* at
        # a = 1 (else a large a moves the loss by removing the model's own eps effect).
        rounding = moved and max(ratio, eps / v_med) <= ROUNDING_BELOW
        res.sweep.append(SweepPoint(a, dl, ratio, in_window, bool(rounding)))
    res.slope, res.constant, res.fit_note = fit_sweep(res.sweep)
    return res


def fit_sweep(sweep: Sequence[SweepPoint]) -> tuple[float, float, str]:
    """``(slope, constant, note)`` of ``|dloss| = constant (eps/v)^slope`` over the points in
    the window, or nan and nan with the reason there is no meaningful fit.

    The delta-loss has a sign (scaling the input down shrinks the logits, which can lower a
    held-out loss), and a power law fits one sign: the fit uses the longest run of window
    points, consecutive in eps/v, whose delta-loss has one sign, and needs at least three
    (two points fit any line).  Points of the other sign leave the window points out of the
    fit (``in_fit`` false) and the note says where the sign changes.
    """
    window = sorted((p for p in sweep if p.in_fit), key=lambda p: p.eps_over_var)
    runs: list[list[SweepPoint]] = []
    for p in window:
        if runs and (runs[-1][-1].dloss > 0) == (p.dloss > 0):
            runs[-1].append(p)
        else:
            runs.append([p])
    best = max(runs, key=len, default=[])
    for p in window:
        p.in_fit = any(p is q for q in best)
    if len(best) < 3:
        why = (f"{len(window)} point(s) in the window {FIT_RANGE[0]:g} < eps/v < {FIT_RANGE[1]:g}"
               if len(runs) <= 1 else
               f"the delta-loss changes sign in the window, leaving {len(best)} point(s) of one sign")
        return math.nan, math.nan, f"no fit: {why}, fewer than 3"
    fx = np.log([p.eps_over_var for p in best])
    fy = np.log([abs(p.dloss) for p in best])
    slope, intercept = np.polyfit(fx, fy, 1)
    sign = "positive" if best[0].dloss > 0 else "negative"
    note = f"fitted on {len(best)} points with a {sign} delta-loss, eps/v {best[0].eps_over_var:.2g} .. " \
           f"{best[-1].eps_over_var:.2g}"
    if len(runs) > 1:
        note += f"; the delta-loss changes sign in the window ({len(window) - len(best)} point(s) left out)"
    return float(slope), float(math.exp(intercept)), note


# share of the loss gradient at the final norm's input allowed to go around the norm (a
# true final norm gives exactly 0: the two gradients are the same numbers)
FINAL_BYPASS_TOLERANCE = 1e-6


class NotAFinalNorm(ValueError):
    """The norm taken as the final norm has a residual path around it: there is no
    final-norm invariance to check."""


class NonFiniteLoss(ValueError):
    """The loss on the probe rows is not finite (a diverged model): no point to measure now."""


class InvarianceProbe:
    """The final-norm invariance probe of one model, run whenever its driver decides.

    ``InvarianceProbe(model).run(batch)`` finds the final norm on the first run (the last
    norm to run, unless ``final_norm`` names it), checks once with
    :func:`final_norm_bypass` that the loss reaches its input only through it (else raises
    :class:`NotAFinalNorm`, whose message says why and what to do), then runs
    :func:`final_norm_invariance`.  ``loss_fn``, ``cases``, ``scales``, ``autocast`` and
    ``norms`` are passed on to it.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn | None = None,
        *,
        final_norm: str | None = None,
        cases: Sequence[str] = CASES,
        scales: Sequence[float] = SWEEP_SCALES,
        autocast: Callable[[], object] | None = None,
        norms: Sequence[NormInfo] | None = None,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn or default_loss
        self.named = final_norm is not None
        self.final_norm = final_norm
        self.cases, self.scales, self.autocast = tuple(cases), tuple(scales), autocast
        self.norms = find_norms(model) if norms is None else list(norms)
        self.checked = False
        self.last: InvarianceResult | None = None  # the last point (see point())
        self.last_step = -1

    def sweep_missing(self, step: int) -> bool:
        """Whether the point of ``step`` was probed last, without its sweep (see :meth:`point`)."""
        return step == self.last_step and self.last is not None and not self.last.sweep and bool(self.scales)

    def point(self, batch, step: int, *, sweep: bool) -> tuple[InvarianceResult, dict[str, float]]:
        """The point of training ``step``: the cases, the sweep too with ``sweep`` (the curves need
        the cases; the sweep is 7 replayed passes more).  A point probed last without its sweep gets the
        sweep alone, added to it.  Returns the point's result and its finite metrics that are new."""
        if sweep and self.sweep_missing(step):
            last, swept = self.last, self.run(batch, cases=False)
            result = replace(last, sweep=swept.sweep, slope=swept.slope, constant=swept.constant,
                             fit_note=swept.fit_note)
            before = last.metrics()
            metrics = {k: v for k, v in finite_metrics(result.metrics()).items() if k not in before}
        else:
            result = self.run(batch, sweep=sweep)
            metrics = finite_metrics(result.metrics())
        self.last, self.last_step = result, step
        return result, metrics

    def run(self, batch, *, cases: bool = True, sweep: bool = True) -> InvarianceResult:
        """One run on ``batch``: the cases and/or the scale sweep (``cases``/``sweep`` False
        leave them out: a run costs one forward pass, and per case and scale the part of a pass
        from the final norm on; see :func:`final_norm_invariance`)."""
        if self.final_norm is None:
            self.final_norm = find_final_norm(self.model, batch, self.loss_fn, self.norms)
        if not self.checked:
            bypass = final_norm_bypass(self.model, batch, _named(self.norms, self.final_norm).module,
                                       loss_fn=self.loss_fn, autocast=self.autocast)
            if bypass > FINAL_BYPASS_TOLERANCE:
                name = self.final_norm
                who = f"final_norm={name!r}" if self.named else f"the last norm to run, {name!r},"
                raise NotAFinalNorm(
                    f"{who} is not a final norm: part of the loss gradient at its "
                    f"input goes around it (relative size {bypass:.3g}; a residual path carries that "
                    "input on), so the loss is not invariant to shifting or scaling it and there is "
                    "no final-norm invariance to check. The model seems to have no final norm before "
                    "its head; if it has one, name it with final_norm=..."
                )
            self.checked = True
        result = final_norm_invariance(
            self.model, batch, self.final_norm, loss_fn=self.loss_fn, cases=self.cases if cases else (),
            scales=self.scales if sweep else (), autocast=self.autocast, norms=self.norms,
        )
        if not math.isfinite(result.base_loss):
            raise NonFiniteLoss(f"the loss on the probe rows is {result.base_loss}: there is no change of it "
                                "to measure (has the model diverged?)")
        return result
