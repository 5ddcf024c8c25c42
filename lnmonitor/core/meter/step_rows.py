"""A measured step's rows: every hooked call's raw reductions finished together.

The taps (:class:`lnmonitor.core.meter.taps.NormTap`) leave, per measured norm call, the raw
per-row reductions of :mod:`lnmonitor.core.maths.reductions` on the device (:class:`RawCall`).
:func:`finish_calls` finishes them at the end of the step into
:data:`~lnmonitor.core.maths.reductions.FIELDS` (the calls that finish alike in one chain of small
operators), makes the padding rows nan and counts them per norm, and marks the rows lost to
rounding, each call against its own mean; :class:`StepRows` is what the tap hands over.
Nothing here calls ``.item()`` or ``.cpu()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from lnmonitor.core.maths.reductions import (
    drop_rounding_rows,
    finish_layernorm_backward,
    finish_rows,
    mask_rows,
    stack_raw,
)

__all__ = ["CallRecord", "RawCall", "StepRows", "finish_calls"]


class CallRecord(NamedTuple):
    """One hooked call's rows in :attr:`StepRows.data`: the norm's index, how many rows, the
    row width, the eps applied and the dead-subspace dimension."""

    norm: int
    rows: int
    width: int
    eps: float
    dead_dim: int


class RawCall(NamedTuple):
    """One measured call as its hook left it: the raw rows (``reductions.*_raw``: five per-row
    tensors), how they are finished (``("rows", kind, width)`` or ``("layernorm", eps, width)``)
    and the rows that are not padding (or None)."""

    raw: tuple[Tensor, ...]
    finish: tuple
    keep: Tensor | None


_FINISH = {"rows": finish_rows, "layernorm": finish_layernorm_backward}


@dataclass
class StepRows:
    """Per-row reductions gathered during one measured step (all on one device).

    ``data`` is ``(5, rows)`` float32 (:data:`~lnmonitor.core.maths.reductions.FIELDS`), ``records``
    lists a :class:`CallRecord` per hooked call, in the order the gradients arrived.
    ``order`` holds the norm indices in the order their forward first ran.  ``bypass`` maps
    a norm index to the float32 pair ``(|dL/dx|^2, |dL/dx - J^T dL/dy|^2)`` summed over its
    rows, when it was measured, and ``resolution`` to the relative resolution of the
    gradient's dtype there.  ``pads`` maps a norm index to the number of its padding rows
    (a device tensor), ``forward_only`` holds the norms whose output got no gradient
    (their rows carry the forward statistics alone), ``calls`` counts each norm's
    measured calls (a module the forward calls more than once is reused), and ``unmasked``
    holds the norms with a row mask that none of their calls' rows lined up with (every row
    measured), and ``refused`` maps a norm to why its ``DTensor`` rows could not be read
    (:func:`lnmonitor.core.dtensors.unsupported`: it has no rows).
    """

    data: Tensor | None
    records: list[CallRecord]
    order: list[int]
    eps: dict[int, float]
    bypass: dict[int, Tensor] = field(default_factory=dict)
    resolution: dict[int, float] = field(default_factory=dict)
    pads: dict[int, Tensor] = field(default_factory=dict)
    forward_only: set[int] = field(default_factory=set)
    calls: dict[int, int] = field(default_factory=dict)
    unmasked: set[int] = field(default_factory=set)
    refused: dict[int, str] = field(default_factory=dict)


def finish_calls(
    calls: list[RawCall], records: list[CallRecord]
) -> tuple[Tensor | None, list[CallRecord], dict[int, Tensor]]:
    """The step's :data:`~lnmonitor.core.maths.reductions.FIELDS` of every call: the calls that
    finish alike finished together, then padding rows made nan (and counted per norm) and
    rounding rows marked, each call against its own mean.  Returns the rows, the records in
    their order and each norm's count of padding rows (a device tensor)."""
    pads: dict[int, Tensor] = {}
    if not calls:
        return None, records, pads
    groups: dict[tuple, list[int]] = {}
    for i, call in enumerate(calls):
        groups.setdefault(call.finish, []).append(i)
    parts = []
    for (how, *key), members in groups.items():
        parts.append(_FINISH[how](stack_raw([calls[i].raw for i in members]), *key))
    order = [i for members in groups.values() for i in members]
    calls, records = [calls[i] for i in order], [records[i] for i in order]
    data = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if any(call.keep is not None for call in calls):
        keep = torch.cat([call.keep if call.keep is not None
                          else torch.ones(record.rows, dtype=torch.bool, device=data.device)
                          for call, record in zip(calls, records, strict=True)])
        data = mask_rows(data, keep)
        for call, record in zip(calls, records, strict=True):
            if call.keep is not None:
                count = call.keep.numel() - call.keep.sum()
                pads[record.norm] = count + pads.get(record.norm, 0)
    counts = [record.rows for record in records]
    if len(set(counts)) == 1:  # the usual step: every call has the same rows
        drop_rounding_rows(data.view(data.shape[0], len(counts), counts[0]))
    else:
        for chunk in torch.split(data, counts, dim=1):
            drop_rounding_rows(chunk)
    return data, records, pads
