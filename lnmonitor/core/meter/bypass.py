"""What goes around a norm: the gradient at the stream it reads against the part through it.

On the role-finding step (``NormTap.attach(bypass=True)``) the taps compare, for each norm,
the whole gradient at its input with the part that came through the norm, ``J^T dL/dy``
(:func:`gradient_through`): what goes around it, ``|dL/dx - J^T dL/dy|^2`` against
``|dL/dx|^2``, says whether the norm reads the residual stream, whose input flows on past it,
or a branch (:mod:`lnmonitor.core.norms.roles` decides from it).  :func:`on_stream_gradient` finds
the tensor whose gradient is the whole one when the norm reads a cast or a ``DTensor`` of
the stream.
"""

from __future__ import annotations

from torch import Tensor

from lnmonitor.core import dtensors
from lnmonitor.core.kinds import NormKind

__all__ = ["gradient_through", "on_stream_gradient"]


def on_stream_gradient(x: Tensor, fn) -> None:
    """``fn(total)`` with the whole gradient at the stream a norm reads: ``x`` itself, or, when
    ``x`` is a dtype cast of it (``h.to(weight.dtype)``: Mamba's ``residual_in_fp32`` keeps the
    float32 stream for the residual and casts a copy for the norm, which nothing else reads)
    or a ``DTensor`` made of it (``SequenceParallel``'s input hook: ``DTensor.from_local`` of
    the local rows), the tensor it was made from, whose gradient sums the norm's and the
    residual's."""
    node = x.grad_fn
    if node is None or type(node).__name__ not in dtensors.STREAM_NODES or not node.next_functions:
        x.register_hook(fn)
        return
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
