"""The loss the invariance probe uses when the user gives none: :func:`probe_loss` finds one, once, on the
probe batch (many LightningModules compute their loss only in ``training_step``):

1. ``module(*batch)`` (``module(**batch)`` for a mapping) when it returns a loss: a scalar tensor,
   ``(logits, loss)``, or a mapping or ``ModelOutput`` with ``loss``;
2. else, under automatic optimisation, the loss ``training_step(batch, 0)`` returns (a scalar tensor or a
   mapping with ``loss``), with ``self.log`` and ``self.log_dict`` muted while it runs.

When neither gives a loss, :class:`NoLoss` says what each did and how to pass one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lnmonitor.core.hooks import restored
from lnmonitor.core.invariance.loss_contract import LossFn, default_loss, split_output

__all__ = ["NoLoss", "probe_loss", "training_step_loss"]


class NoLoss(ValueError):
    """No loss could be computed on the probe batch without the user's help."""


@contextlib.contextmanager
def _muted_logging(module: LightningModule) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing for the duration."""
    saved = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.log = lambda *args, **kwargs: None
    module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)


def training_step_loss(module: LightningModule, batch) -> Tensor:
    """The loss ``module.training_step(batch, 0)`` returns, with logging muted."""
    with _muted_logging(module):
        out = module.training_step(batch, 0)
    if isinstance(out, Mapping) and "loss" in out:
        out = out["loss"]
    if not isinstance(out, Tensor) or out.numel() != 1:
        raise NoLoss(f"training_step returned {type(out).__name__}, not a loss")
    return out.reshape(())


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160]}" if text else type(err).__name__


def probe_loss(module: LightningModule, batch) -> LossFn:
    """A loss function for the invariance probe on ``batch`` (see above); raises :class:`NoLoss` if none."""
    tried = []
    for name, fn in (("forward(*batch)", default_loss), ("training_step(batch, 0)", training_step_loss)):
        if fn is training_step_loss and not module.automatic_optimization:
            tried.append("training_step: manual optimisation, its return value is not a loss")
            continue
        try:
            with restored(module, batch), torch.no_grad():
                split_output(fn(module, batch))
        except Exception as err:  # noqa: BLE001 - the user's code: try the next, say what happened
            tried.append(f"{name}: {_first_line(err)}")
            continue
        return fn
    raise NoLoss(
        "it cannot compute a loss on the probe batch without help ("
        + "; ".join(tried)
        + "). Pass loss_fn=lambda module, batch: ... returning the loss (or (logits, loss)) for the "
        "probe batch, and final_norm='...' if the last norm to run is not the final norm"
    )
