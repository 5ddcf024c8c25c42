"""The held-out rows the invariance probe runs on, taken from a data loader.

A batch is a tensor, or a mapping (a ``BatchEncoding`` included), tuple, named tuple or list of them.
:func:`first_samples` gathers the first ``size`` samples from as many batches as it takes, padding batches of
different lengths to the longest on the side their ``attention_mask`` pads: ``input_ids`` with the pad id
(:func:`pad_id_of`), ``attention_mask`` with 0, ``labels`` with -100.  A batch it cannot join ends the
gathering, said once by name.  :func:`probe_batch` keeps the first ``size`` rows as detached copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lnmonitor.core.meter.padding import padding_mask

__all__ = ["Padding", "first_samples", "labels_problem", "map_tensors", "pad_id_of", "probe_batch"]

LABEL_PAD = -100  # the ignore_index of torch's cross entropy, and of every transformers loss
# the value each known key is padded with; the ids' pad value is the model's (Padding)
_PAD_VALUES = {"attention_mask": 0, "decoder_attention_mask": 0, "token_type_ids": 0, "labels": LABEL_PAD}
_ID_KEYS = ("input_ids", "decoder_input_ids")


class Padding(NamedTuple):
    """The id ``input_ids`` are padded with, and where it came from (said with it)."""

    id: int
    source: str


class _Unjoinable(ValueError):
    """A batch that cannot be joined to the ones before it (the message names the key)."""


def pad_id_of(model: nn.Module | None = None, tokenizer=None) -> Padding:
    """The pad id of ``tokenizer`` (its ``pad_token_id``), else of the first module of ``model`` with a
    ``config.pad_token_id``, else 0, said so."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if isinstance(pad, int):
        return Padding(pad, "the tokenizer's pad_token_id")
    for module in model.modules() if model is not None else ():
        pad = getattr(getattr(module, "config", None), "pad_token_id", None)
        if isinstance(pad, int):
            return Padding(pad, "the model config's pad_token_id")
    return Padding(0, "0: neither the tokenizer nor the model config has a pad_token_id")


def map_tensors(batch, fn: Callable[[Tensor], object]):
    """``batch`` with ``fn`` applied to every tensor in it (mappings, tuples and lists rebuilt with their own
    type; other leaves kept)."""
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


def _left_padded(batch) -> bool:
    """Whether ``batch``'s ``attention_mask`` pads on the left (every last token real, some first not)."""
    found = padding_mask(batch)
    return found is not None and bool(found[0][:, -1].all()) and not bool(found[0][:, 0].all())


def _pad_tensors(parts: list[Tensor], value: int, left: list[bool]) -> Tensor:
    width = max(t.shape[1] for t in parts)
    return torch.cat([F.pad(t, (width - t.shape[1], 0) if lft else (0, width - t.shape[1]), value=value)
                      for t, lft in zip(parts, left, strict=True)])


def _join_tensors(parts: list, key: str, pad: Padding, left: list[bool], masked: bool) -> Tensor:
    if not all(isinstance(t, Tensor) for t in parts):
        raise _Unjoinable(f"{key!r} is a tensor in one batch and not in another")
    if len({t.shape[1:] for t in parts}) == 1:
        return torch.cat(parts)
    if {t.ndim for t in parts} != {2}:
        shapes = sorted({tuple(t.shape) for t in parts})
        raise _Unjoinable(f"{key!r} has shapes {shapes}, which no padding joins")
    name = key.rsplit(".", 1)[-1]
    if name in _ID_KEYS and masked:
        return _pad_tensors(parts, pad.id, left)
    if name in _PAD_VALUES:
        return _pad_tensors(parts, _PAD_VALUES[name], left)
    why = "no attention_mask marks the padding" if name in _ID_KEYS else "lnmonitor knows no pad value for it"
    lengths = sorted({t.shape[1] for t in parts})
    raise _Unjoinable(f"{key!r} has rows of different lengths ({lengths}) and {why}")


def _join(parts: list, key: str, pad: Padding, left: list[bool], masked: bool):
    """The same leaf of every batch, joined along the samples (``key`` names it)."""
    first = parts[0]
    if isinstance(first, Tensor):
        return _join_tensors(parts, key or "the batch", pad, left, masked)
    if isinstance(first, Mapping):
        if any(not isinstance(p, Mapping) or p.keys() != first.keys() for p in parts):
            raise _Unjoinable(f"the batches' keys differ ({sorted(first)} and others)")
        joined = {k: _join([p[k] for p in parts], f"{key}.{k}" if key else str(k), pad, left, masked)
                  for k in first}
        return type(first)(joined)
    if isinstance(first, (tuple, list)):
        if any(not isinstance(p, (tuple, list)) or len(p) != len(first) for p in parts):
            raise _Unjoinable(f"{key or 'the batch'} has a different length in another batch")
        items = [_join([p[i] for p in parts], f"{key or 'batch'}[{i}]", pad, left, masked)
                 for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if all(p is None for p in parts):
        return None
    raise _Unjoinable(f"{key or 'the batch'!r} holds a {type(first).__name__}, not a tensor, which has no "
                      "rows to join")


def _read(loader, size: int | None, warn: Callable[[str], None]) -> list:
    """The first batches of ``loader``, enough for ``size`` samples (one when it cannot count)."""
    batches, seen = [], 0
    try:
        for batch in loader:
            batches.append(batch)
            samples = _samples(batch)
            seen += samples or 0
            if size is None or samples is None or seen >= size:
                break
    except Exception as err:  # noqa: BLE001 - the user's loader: take what it gave
        warn(f"reading the probe rows, the loader raised {type(err).__name__}: {err}; the probe takes "
             f"the {len(batches)} batch(es) read before")
    return batches


def first_samples(loaders, size: int | None, *, pad: Padding | None = None,
                  info: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None):
    """The first ``size`` samples of a loader (or of the first of a list or dict of them), joined; None when
    there is none.  ``pad``: the id ``input_ids`` are padded with (default 0, said); ``info`` gets what was
    padded, ``warn`` why a batch could not be joined or read (once each).  Never raises on the loader's
    account."""
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    elif isinstance(loaders, dict):
        loaders = next(iter(loaders.values()), None)
    if loaders is None:
        return None
    warn = warn or (lambda text: None)
    pad = pad or pad_id_of()
    batches = _read(loaders, size, warn)
    if len(batches) <= 1:
        return batches[0] if batches else None
    joined, used = batches[0], 1
    for batch in batches[1:]:
        pair = [joined, batch]
        try:
            masked = all(padding_mask(b) is not None for b in pair)
            joined = _join(pair, "", pad, [_left_padded(b) for b in pair], masked)
        except _Unjoinable as err:
            warn(f"batch {used + 1} cannot be joined to the probe rows before it: {err}; the probe takes the "
                 f"rows of the first {used} batch(es)")
            break
        used += 1
    widths = {t.shape[1] for b in batches[:used] if isinstance(b, Mapping) for k, t in b.items()
              if k in _ID_KEYS and isinstance(t, Tensor) and t.ndim == 2}
    if info is not None and len(widths) > 1:
        info(f"the probe rows join {used} batches padded to different lengths ({min(widths)} to "
             f"{max(widths)} tokens): each is padded to the longest on its own side, input_ids with "
             f"{pad.id} ({pad.source}), attention_mask with 0, labels with {LABEL_PAD}")
    return joined


def probe_batch(batch, size: int | None):
    """The first ``size`` rows of ``batch`` (all when None) as detached copies."""
    if size is not None:
        batch = map_tensors(batch, lambda t: t[:size] if t.ndim > 0 else t)
    return map_tensors(batch, lambda t: t.detach().clone())


def labels_problem(batch, label_names: Sequence[str]) -> str | None:
    """Why ``model(**batch).loss`` gives the probe no loss on ``batch`` (None: it does)."""
    if batch is None:
        return "there is no eval or training data to take probe rows from"
    if not isinstance(batch, Mapping):
        return (f"the collator's batches are a {type(batch).__name__}, not a mapping of tensors: the probe "
                "calls model(**batch) as the Trainer does")
    if not any(name in batch for name in label_names):
        return (f"the probe rows have no {' or '.join(map(repr, label_names))} (their keys: "
                f"{', '.join(map(str, batch))}), so model(**batch) gives no loss: a collator that adds "
                "labels (DataCollatorForLanguageModeling(tokenizer, mlm=False) for a causal LM) gives the "
                "probe one")
    return None
