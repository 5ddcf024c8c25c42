"""What the taps do with ``DTensor`` activations (tensor parallelism, ``torch.distributed.tensor``).

A tensor-parallel norm's input, output and gradient may be ``DTensor``s.  The taps reduce each
rank's *local* rows (:func:`local`): a norm normalises each row over its last dimension, so a
row is whole on a rank as long as the last dimension is not sharded; which ranks hold which
rows does not matter here (the merge counts rows several ranks hold alike once,
:mod:`lnmonitor.core.maths.replicas`).  :func:`unsupported` names the layouts whose local rows are
not whole rows of the norm (the feature dimension sharded, a ``Partial`` sum still to be
reduced).  No collective is run here except to bring a gradient into its input's layout when
the two differ (every rank's backward does the same, so it cannot hang).

The invariance probe instead works on whole tensors (:func:`whole`, :func:`laid_out`): its
forward is a collective that every rank runs on the same probe rows, so each rank gathers the
final norm's input, transforms and normalises it as one process would, and hands the model
back its own part.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lnmonitor.core import zero3

__all__ = [
    "STREAM_NODES", "flat64", "is_dtensor", "laid_out", "layout", "local", "summed", "unsharded",
    "unsupported", "whole",
]

# autograd nodes between the tensor a norm's caller passed and what the norm reads, whose
# gradient reaches the caller's tensor unchanged in shape: a dtype cast (Mamba's
# residual_in_fp32), and DTensor.from_local (SequenceParallel's input hook on the local rows)
STREAM_NODES = ("ToCopyBackward0", "_FromTorchTensorBackward")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism)."""
    return isinstance(t, Tensor) and hasattr(t, "to_local") and hasattr(t, "placements")


def layout(t: Tensor) -> str:
    """``t``'s placements as torch writes them, e.g. ``(Shard(dim=1),)``."""
    return repr(tuple(t.placements))


def unsupported(*tensors: object) -> str | None:
    """What makes a norm call's rows unreadable from the local tensors, or None: a ``DTensor``
    among ``tensors`` (the input, the output) sharded along its last dimension (each rank
    holds part of every row) or ``Partial`` (each rank holds a summand)."""
    for t in tensors:
        if not is_dtensor(t):
            continue
        for p in t.placements:
            if p.is_partial():
                return f"a Partial placement {layout(t)}: each rank holds a summand of every row"
            if p.is_shard() and p.dim % t.ndim == t.ndim - 1:
                return f"the feature dimension sharded {layout(t)}: each rank holds part of every row"
    return None


def local(t: Tensor, like: Tensor | None = None) -> Tensor:
    """``t``'s local part (``t`` itself when it is no ``DTensor``); with ``like`` (a ``DTensor``)
    ``t`` is first laid out as ``like`` is, so that the local parts line up row for row."""
    if not is_dtensor(t):
        return t
    if like is not None and is_dtensor(like) and tuple(t.placements) != tuple(like.placements):
        t = t.redistribute(like.device_mesh, like.placements)
    return t.to_local()


def whole(t: object) -> object:
    """``t`` whole on every rank (``full_tensor()``: a collective every rank of its mesh joins)
    when it is a ``DTensor``; else ``t`` itself."""
    return t.full_tensor() if is_dtensor(t) else t


def unsharded(t: Tensor) -> Tensor:
    """A tensor a module holds (a norm's gain or bias), whole: ``t`` itself, or a sharded
    ``DTensor`` or a partitioned ZeRO-3 parameter gathered, detached (a collective every rank
    joins: FSDP2 holds a norm that is its own unit sharded again when its forward hooks run,
    ZeRO-3 one whose parameters it partitioned again: :func:`lnmonitor.core.zero3.whole`)."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else zero3.whole(t)


def flat64(t: Tensor | None) -> Tensor | None:
    """``t`` as a plain flat float64 tensor, detached (a sharded ``DTensor`` is gathered:
    :func:`unsharded`, a collective); None stays None."""
    if t is None:
        return None
    return unsharded(t).detach().reshape(-1).to(torch.float64)


def laid_out(full: Tensor, output: Tensor, stream: Tensor) -> Tensor:
    """``full`` (a whole tensor, the same on every rank) laid out as a norm's ``output`` is:
    a ``DTensor`` with the output's placements, or, when the output is a local tensor and the
    input ``stream`` a ``DTensor``, this rank's part in the input's layout (no collective:
    ``Replicate`` to ``Shard`` keeps a local chunk).  ``full`` itself when neither is a ``DTensor``."""
    like = output if is_dtensor(output) else stream if is_dtensor(stream) else None
    if like is None:
        return full
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    spread = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    spread = spread.redistribute(mesh, like.placements)
    return spread if is_dtensor(output) else spread.to_local()


def summed(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (a local tensor) summed over every rank of ``like``'s mesh when ``like`` is a
    ``DTensor`` (an all-reduce), else ``t``.  Sums of squares of a replicated tensor count it
    once per rank, which leaves their ratios as they are."""
    if not is_dtensor(like):
        return t
    from torch.distributed.tensor import DTensor, Partial

    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Partial()] * mesh.ndim, run_check=False).full_tensor()
