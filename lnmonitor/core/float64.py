"""The float64 reference of a module: its forward from float64 copies of its parameters and buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lnmonitor.core import dtensors
from lnmonitor.core.hooks import unmeasured

__all__ = ["float64_forward"]


def float64_forward(module: nn.Module) -> Callable[..., object]:
    """``f(*args)``: ``module.forward`` with float64 copies of its parameters and buffers (a sharded
    one gathered: a collective), invisible to the taps and running no hook.  The module is neither
    copied nor changed (FSDP2 refuses ``deepcopy``); gradients flow to the inputs only."""
    state = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        t = dtensors.unsharded(t).detach()
        state[f"module.{name}"] = t.to(torch.float64) if t.is_floating_point() else t
    forward = _Forward(module)

    def in_float64(*args):
        with unmeasured():
            return torch.func.functional_call(forward, state, args)

    return in_float64


class _Forward(nn.Module):
    """``module.forward`` as a module of its own whose ``__call__`` runs no hook (nor global ones)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module.forward(*args)

    def __call__(self, *args):
        return self.forward(*args)
