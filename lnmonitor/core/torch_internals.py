"""The private torch APIs the norm taps use, each looked up once, each with a fallback to the plain
path, so a rename in torch costs speed, never a user's forward."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["backward_running", "layernorm_saved_stats", "saved_tensor_hooks_active"]

_top_saved_hooks = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_saved_stats_readable = True  # cleared for good the first time reading them fails


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (checkpointing, ``save_on_cpu``) pack what autograd saves now
    (unknown: True)."""
    if _top_saved_hooks is None:
        return True
    try:
        return _top_saved_hooks(False) is not None
    except Exception:  # noqa: BLE001 - a changed signature: assume the safe answer
        return True


def backward_running() -> bool | None:
    """Whether a backward pass is running (a forward inside it is checkpointing's recompute); None:
    unknown."""
    if _graph_task_id is None:
        return None
    try:
        return _graph_task_id() != -1
    except Exception:  # noqa: BLE001
        return None


def layernorm_saved_stats(output: Tensor, rows: int) -> tuple[Tensor, Tensor] | None:
    """``(mean, rstd)`` that the ``native_layer_norm`` producing ``output`` saved, ``rows`` entries
    each; None when ``output`` came from elsewhere or torch no longer exposes them."""
    global _saved_stats_readable
    fn = output.grad_fn
    if not _saved_stats_readable or fn is None or fn.name() != "NativeLayerNormBackward0":
        return None
    try:
        if len(fn._saved_normalized_shape) != 1:
            return None
        mean, rstd = fn._saved_result1, fn._saved_result2
    except AttributeError:  # renamed in this torch: the input path from now on
        _saved_stats_readable = False
        return None
    except RuntimeError:  # freed, or packed by saved-tensor hooks: this call only
        return None
    if not (isinstance(mean, Tensor) and isinstance(rstd, Tensor)) or {mean.numel(), rstd.numel()} != {rows}:
        return None
    return mean, rstd
