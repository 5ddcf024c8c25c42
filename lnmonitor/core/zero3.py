"""DeepSpeed ZeRO stage 3's partitioned parameters, whole when lnmonitor reads them.

ZeRO-3 keeps each rank's part of a parameter in ``param.ds_tensor`` and leaves ``param.data`` an
empty tensor outside the forward of the module that owns it (``ds_shape`` and ``ds_numel`` give
its real size, ``ds_status`` whether it is whole now); a parameter of fewer elements than
``stage3_param_persistence_threshold`` is gathered at the first forward and stays whole after.
lnmonitor reads a norm's parameters when it finds the norms (the float64 check: :func:`gathered`
around it) and its gain and bias in forward hooks (the taps, the invariance probe:
:func:`whole`, through :func:`lnmonitor.core.dtensors.unsharded`).  A partitioned parameter is
gathered with ``deepspeed.zero.GatheredParameters`` -- a collective that every rank joins, as
every rank finds the same norms and runs the same forward -- and partitioned again after; a
parameter that is whole already is read as it is, without a collective.  Nothing here imports
deepspeed unless a parameter is partitioned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

__all__ = ["gathered", "holds", "partitioned", "whole"]


def partitioned(t: object) -> bool:
    """Whether ``t`` is a ZeRO-3 parameter whose data this rank does not hold whole now."""
    return hasattr(t, "ds_id") and getattr(getattr(t, "ds_status", None), "name", None) == "NOT_AVAILABLE"


def holds(module: nn.Module) -> bool:
    """Whether ``module`` holds ZeRO-3 parameters, partitioned or not: its forward gathers them,
    a collective every rank must join."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """``module``'s partitioned parameters whole on every rank for the duration (a collective
    every rank joins), partitioned again after; no collective when none is partitioned."""
    params = [p for p in module.parameters() if partitioned(p)]
    if not params:
        yield
        return
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(params):
        yield


def whole(t: Tensor) -> Tensor:
    """``t`` whole, detached: a partitioned parameter gathered into a copy (a collective every
    rank joins); else ``t`` itself."""
    if not partitioned(t):
        return t
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters([t]):
        return t.detach().clone()
