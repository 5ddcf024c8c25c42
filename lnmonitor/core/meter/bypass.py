"""What goes around a norm: on the role-finding step the taps compare the whole gradient at a norm's input
with the part through it, ``J^T dL/dy``; what goes around says whether the norm reads the residual stream or
a branch (:mod:`lnmonitor.core.norms.roles`).
"""

from __future__ import annotations

from torch import Tensor

from lnmonitor.core import dtensors
from lnmonitor.core.kinds import NormKind

__all__ = ["gradient_through", "on_stream_gradient"]


def on_stream_gradient(x: Tensor, fn) -> None:
    """``fn(total)`` with the whole gradient at the stream a norm reads: ``x``'s, or, when ``x`` is a dtype
    cast of the stream (Mamba's ``residual_in_fp32``) or a ``DTensor`` made of it (``SequenceParallel``),
    the gradient of the tensor it was made from, which sums the norm's and the residual's."""
    node, source = x.grad_fn, None
    if node is not None and type(node).__name__ in dtensors.STREAM_NODES and node.next_functions:
        source, output = node.next_functions[0]
    if source is None:
        x.register_hook(fn)
    elif hasattr(source, "variable"):  # a leaf: its AccumulateGrad node
        source.variable.register_hook(fn)
    else:
        source.register_prehook(lambda grads: None if grads[output] is None else fn(grads[output]))


def gradient_through(x: Tensor, g: Tensor, kind: NormKind, eps: float, gain: Tensor | None) -> Tensor:
    """``J^T dL/dy`` of a norm in float32: ``(1/sigma) (w - mean(w) - (w.xhat/d) xhat)`` with
    ``w = gain * dL/dy`` (RMSNorm: without the mean)."""
    x, g = x.float(), g.float()
    w = g * gain.detach().reshape(-1).float() if gain is not None else g
    xc = x - x.mean(-1, keepdim=True) if kind == "layer" else x
    sigma = (xc.square().mean(-1, keepdim=True) + eps).sqrt()
    xhat = xc / sigma
    out = w - (w * xhat).mean(-1, keepdim=True) * xhat
    if kind == "layer":
        out = out - w.mean(-1, keepdim=True)
    return out / sigma
