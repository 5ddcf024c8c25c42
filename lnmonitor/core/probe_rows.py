"""The held-out rows the invariance probe runs on, taken from a data loader.

Batches are whatever a loader yields: a tensor, or a mapping (a ``transformers``
``BatchEncoding`` included), tuple, named tuple or list of them.  :func:`first_samples`
gathers the first ``size`` samples from as many batches as it takes;
:func:`probe_batch` keeps the first ``size`` rows of a batch as detached copies (nothing
of the user's batch is held or changed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

__all__ = ["first_samples", "map_tensors", "probe_batch"]


def map_tensors(batch, fn: Callable[[Tensor], object]):
    """``batch`` with ``fn`` applied to every tensor in it (mappings, tuples and lists are
    rebuilt with their own type; other leaves are kept as they are)."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def _samples(batch) -> int | None:
    """Samples in a batch whose tensors share their first dimension, else None."""
    sizes: set = set()
    map_tensors(batch, lambda t: sizes.add(t.shape[0] if t.ndim else None))
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def _concat(batches: list):
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return type(first)({k: _concat([b[k] for b in batches]) for k in first})
    if isinstance(first, (tuple, list)):
        parts = [_concat([b[i] for b in batches]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return first


def first_samples(loaders, size: int | None):
    """The first ``size`` samples of a loader (or of the first of a list or dict of them),
    gathered from as many batches as it takes (batches that are tensors or collections of
    them; otherwise the first batch); None when there is none or it cannot be read."""
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    elif isinstance(loaders, dict):
        loaders = next(iter(loaders.values()), None)
    if loaders is None:
        return None
    batches, seen = [], 0
    try:
        for batch in loaders:
            batches.append(batch)
            samples = _samples(batch)
            seen += samples or 0
            if size is None or samples is None or seen >= size:
                break
    except Exception:  # noqa: BLE001 - an empty or unreadable loader: fall back
        pass
    if len(batches) <= 1:
        return batches[0] if batches else None
    return _concat(batches)


def probe_batch(batch, size: int | None):
    """The first ``size`` rows of ``batch`` (all when None) as detached copies."""
    if size is not None:
        batch = map_tensors(batch, lambda t: t[:size] if t.ndim > 0 else t)
    return map_tensors(batch, lambda t: t.detach().clone())
