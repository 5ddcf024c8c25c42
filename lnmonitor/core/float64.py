"""The float64 reference of a module: its forward evaluated from float64 copies of its parameters
and buffers, the exact value every float32 statistic is checked against.

:func:`float64_forward` neither copies nor changes the module (so it works where ``deepcopy`` is
refused: FSDP2) and runs no hook; :func:`float64_state` gathers a sharded parameter first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors
from lnmonitor.core.hooks import unmeasured

__all__ = ["float64_state", "float64_forward"]

def float64_state(module: nn.Module) -> dict[str, Tensor]:
    """Float64 copies of ``module``'s floating-point parameters and buffers (on their
    device), by qualified name; a sharded ``DTensor`` or a partitioned ZeRO-3 parameter is
    gathered first (a collective: every rank must call this together)."""
    state = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        t = dtensors.unsharded(t).detach()
        state[name] = t.to(torch.float64) if t.is_floating_point() else t
    return state


def float64_forward(module: nn.Module) -> Callable[..., object]:
    """``f(*args)``: ``module``'s forward evaluated with float64 copies of its parameters
    and buffers (``torch.func.functional_call``), invisible to the taps.  The module is
    neither copied nor changed, so this also works where ``deepcopy`` is refused (FSDP2).

    It calls ``module.forward`` itself, not the module: no hook registered on
    ``module`` runs (the user's forward hooks, the global module hooks, an FSDP2 unit's or a
    tensor-parallel norm's hooks that lay out tensors across ranks), so evaluating it has no
    side effect.  A sharded parameter (``DTensor``) is gathered into its copy first.
    Gradients flow to the inputs, not to the parameters."""
    state = {f"module.{name}": t for name, t in float64_state(module).items()}
    forward = _Forward(module)

    def in_float64(*args):
        with unmeasured():
            return torch.func.functional_call(forward, state, args)

    return in_float64


class _Forward(nn.Module):
    """``module.forward`` as a module of its own, called without any hook: neither those on
    ``module`` nor the global module hooks (its own ``__call__`` is its ``forward``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module.forward(*args)

    def __call__(self, *args):
        return self.forward(*args)
