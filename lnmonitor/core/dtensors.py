"""``DTensor`` activations (tensor parallelism): the taps reduce each rank's *local* rows (:func:`local`),
whole rows unless the feature dimension is sharded or ``Partial`` (:func:`unsupported`); the invariance
probe gathers whole tensors (:func:`whole`) and hands each rank back its part (:func:`laid_out`)."""

from __future__ import annotations

import torch
from torch import Tensor

from lnmonitor.core import zero3

__all__ = [
    "STREAM_NODES", "flat64", "is_dtensor", "laid_out", "local", "summed", "unsharded",
    "unsupported", "whole",
]

# autograd nodes between a norm's caller's tensor and what the norm reads that keep the gradient's
# shape: a dtype cast (Mamba's residual_in_fp32), DTensor.from_local (SequenceParallel's input hook)
STREAM_NODES = ("ToCopyBackward0", "_FromTorchTensorBackward")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism)."""
    return isinstance(t, Tensor) and hasattr(t, "to_local") and hasattr(t, "placements")


def unsupported(*tensors: object) -> str | None:
    """Why a norm call's rows cannot be read from the local tensors (a ``DTensor`` among ``tensors``
    sharded along its last dimension, or ``Partial``), or None."""
    for t in filter(is_dtensor, tensors):
        layout = repr(tuple(t.placements))
        for p in t.placements:
            if p.is_partial():
                return f"a Partial placement {layout}: each rank holds a summand of every row"
            if p.is_shard() and p.dim % t.ndim == t.ndim - 1:
                return f"the feature dimension sharded {layout}: each rank holds part of every row"
    return None


def local(t: Tensor, like: Tensor | None = None) -> Tensor:
    """``t``'s local part (``t`` itself when no ``DTensor``), first laid out as ``like`` when given, so
    that the local parts line up row for row."""
    if not is_dtensor(t):
        return t
    if like is not None and is_dtensor(like) and tuple(t.placements) != tuple(like.placements):
        t = t.redistribute(like.device_mesh, like.placements)
    return t.to_local()


def whole(t: object) -> object:
    """A ``DTensor`` whole on every rank (a collective), else ``t`` itself."""
    return t.full_tensor() if is_dtensor(t) else t


def unsharded(t: Tensor) -> Tensor:
    """A module's tensor (a norm's gain or bias) whole: a sharded ``DTensor`` or a partitioned ZeRO-3
    parameter gathered and detached (a collective), else ``t`` itself."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else zero3.whole(t)


def flat64(t: Tensor | None) -> Tensor | None:
    """``t`` :func:`unsharded`, detached, flat, in float64; None stays None."""
    return None if t is None else unsharded(t).detach().reshape(-1).to(torch.float64)


def laid_out(full: Tensor, output: Tensor, stream: Tensor) -> Tensor:
    """``full`` (whole, the same on every rank) laid out as a norm's ``output``: a ``DTensor`` with its
    placements, or, for a local output of a ``DTensor`` input ``stream``, this rank's part in the
    input's layout; ``full`` itself when neither is a ``DTensor``."""
    like = output if is_dtensor(output) else stream if is_dtensor(stream) else None
    if like is None:
        return full
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    spread = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    spread = spread.redistribute(mesh, like.placements)
    return spread if is_dtensor(output) else spread.to_local()


def summed(t: Tensor, like: Tensor) -> Tensor:
    """``t`` summed over ``like``'s mesh (an all-reduce) when ``like`` is a ``DTensor``, else ``t``."""
    if not is_dtensor(like):
        return t
    from torch.distributed.tensor import DTensor, Partial

    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Partial()] * mesh.ndim, run_check=False).full_tensor()
