"""Which norm is final, and whether it is: found by a forward, checked by the gradient.

:func:`find_final_norm` takes the last norm to run (the meter's rule,
:func:`~lnmonitor.core.norms.roles.assign_roles`, on the probe's own rows).  Without a final norm that is a
block's norm whose input also flows on through the residual, where the cases would wrongly read zero:
:func:`final_norm_bypass` measures the share of the loss gradient at the norm's input that goes around it,
and the probe refuses (:class:`NotAFinalNorm`) above :data:`FINAL_BYPASS_TOLERANCE`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors
from lnmonitor.core.hooks import Hooks, restored
from lnmonitor.core.invariance.loss_contract import LossFn, default_loss, split_output
from lnmonitor.core.invariance.probe_rows import map_tensors
from lnmonitor.core.norms.find import NormInfo, find_norms

__all__ = [
    "FINAL_BYPASS_TOLERANCE", "NotAFinalNorm", "final_norm_bypass", "find_final_norm", "named_norm",
]

# share of the loss gradient at the final norm's input allowed to go around it (a true final norm: exactly 0)
FINAL_BYPASS_TOLERANCE = 1e-6


class NotAFinalNorm(ValueError):
    """The norm taken as the final norm has a residual path around it: no invariance to check."""


def named_norm(norms: Sequence[NormInfo], final_norm: nn.Module | str) -> NormInfo:
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
    """Qualified name of the last of ``norms`` (default: every norm) to run in ``module``'s forward on
    ``batch``, under ``no_grad`` in eval mode."""
    norms = find_norms(module) if norms is None else list(norms)
    if not norms:
        raise ValueError("the module has no normalisation layer (see lnmonitor.core.norms.find.find_norms)")
    order: list[str] = []
    with Hooks() as hooks, restored(module, batch), torch.no_grad():
        for info in norms:
            hooks.forward(info.module, lambda m, a, o, n=info.name: order.append(n))
        (loss_fn or default_loss)(module, batch)
    if not order:
        raise ValueError("no normalisation layer ran in the forward: name the final norm explicitly")
    return order[-1]


def final_norm_bypass(module: nn.Module, batch, final_norm: nn.Module | str, *, loss_fn: LossFn | None = None,
                      autocast: Callable[[], object] | None = None) -> float:
    """How much of the loss's dependence on the final norm's input ``h`` goes around the norm, in eval mode:
    ``|dL/dh - J^T dL/dy| / |dL/dh|`` on ``batch`` (``J`` the norm's Jacobian, ``y`` its output). 0 for a true
    final norm; of order 1 when a residual path carries ``h`` on; 1.0 when the loss does not depend on the
    norm's output; nan when it cannot tell. Parameters' ``.grad`` are not touched. ``h`` is the tensor the
    norm's caller passed (before a tensor-parallel input hook makes a ``DTensor`` of it), and the norms are
    summed over the ranks of a ``DTensor`` input's mesh."""
    loss_fn = loss_fn or default_loss
    norm = module.get_submodule(final_norm) if isinstance(final_norm, str) else final_norm
    ctx = autocast or nullcontext
    seen: dict = {}

    def passed(mod, args):
        if "passed" not in seen and args and isinstance(args[0], Tensor):
            seen["passed"] = args[0]

    def hook(mod, args, output):
        if "h" not in seen and args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
            seen["h"], seen["y"], seen["input"] = seen.get("passed", args[0]), output, args[0]

    with Hooks() as hooks, torch.inference_mode(False), torch.enable_grad():
        hooks.forward_pre(norm, passed, prepend=True)
        hooks.forward(norm, hook)
        batch = map_tensors(batch, lambda t: t.clone() if t.is_inference() else t)  # not an inference tensor
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
