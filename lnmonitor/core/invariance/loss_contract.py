"""The loss contract of the invariance probe: ``loss_fn(module, batch)`` (:data:`LossFn`) returns the loss or
``(logits, loss)``; :func:`default_loss` calls the module with the batch; :func:`split_output` reads a
forward's output."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor, nn

__all__ = ["LossFn", "default_loss", "split_output"]

LossFn = Callable[[nn.Module, object], object]


def split_output(out) -> tuple[Tensor, Tensor | None]:
    """``(loss, logits)`` from a forward output: a scalar loss, ``(logits, loss)``, or a mapping with
    ``"loss"`` (and optionally ``"logits"``)."""
    if isinstance(out, Tensor):
        if out.numel() != 1:
            raise ValueError(f"the forward returned a tensor of shape {tuple(out.shape)}, not a scalar loss: "
                             "pass loss_fn(module, batch) returning the loss or (logits, loss)")
        return out, None
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"], out.get("logits")
    if isinstance(out, (tuple, list)) and len(out) == 2:
        logits, loss = out
        if isinstance(loss, Tensor) and loss.numel() == 1:
            return loss, logits if isinstance(logits, Tensor) else None
    raise ValueError(f"cannot find a loss in a forward output of type {type(out).__name__}: the default "
                     "expects module(x, y) to return a loss or (logits, loss); pass loss_fn(module, batch)")


def default_loss(module: nn.Module, batch):
    """``module(*batch)`` for a tuple/list batch, ``module(**batch)`` for any mapping (a ``BatchEncoding``
    included), else ``module(batch)``."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)
