"""DeepSpeed ZeRO-3's partitioned parameters (``param.data`` empty outside their module's forward),
gathered when lnmonitor reads them (``GatheredParameters``: a collective every rank joins); whole
ones are read as they are, and deepspeed is imported only for a partitioned one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

__all__ = ["gathered", "holds", "partitioned", "whole"]


def partitioned(t: object) -> bool:
    """Whether ``t`` is a ZeRO-3 parameter whose data this rank does not hold whole now."""
    return hasattr(t, "ds_id") and getattr(getattr(t, "ds_status", None), "name", None) == "NOT_AVAILABLE"


def holds(module: nn.Module) -> bool:
    """Whether ``module`` holds ZeRO-3 parameters, partitioned or not (its forward is a collective)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """``module``'s partitioned parameters whole for the duration (a collective unless none is)."""
    params = [p for p in module.parameters() if partitioned(p)]
    if not params:
        yield
        return
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(params):
        yield


def whole(t: Tensor) -> Tensor:
    """A partitioned parameter gathered into a detached copy (a collective), else ``t`` itself."""
    if not partitioned(t):
        return t
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters([t]):
        return t.detach().clone()
