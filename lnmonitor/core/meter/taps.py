"""Tap the selected norms for one measured step: :class:`NormTap` hooks them only while a step is
measured (no hook otherwise), and :meth:`NormTap.collect` hands over the step's :class:`StepRows`.

A norm's forward hook keeps a reference to its input (autograd saves it anyway) and hooks the
backward, which reduces the call's rows to five raw float32 numbers a row on the device, a chunk
at a time in scratch buffers shared by the step.  An ``nn.LayerNorm`` with a float32/float64
gradient is read at its backward node from what that backward has anyway (saved mean and rstd,
``dL/dy``, ``dL/dx``: :func:`~lnmonitor.core.maths.reductions.layernorm_backward_raw`); other norms,
and bf16/fp16 gradients (whose rounding that identity cannot stand), reduce the input
(:func:`~lnmonitor.core.maths.reductions.row_raw`).  ``collect`` finishes every call's raw rows
together (:func:`finish_calls`: padding rows nan and counted, rows lost to rounding marked).  No
host sync; nothing survives the step; forwards without gradient and inside
:func:`~lnmonitor.core.hooks.unmeasured` are not measured, but the forward order is recorded.

Activation checkpointing measures each call once: the reentrant recomputation (the original ran
without gradient), or the non-reentrant original (its recomputation, a forward inside a backward
under saved-tensor hooks, is skipped); under saved-tensor hooks a LayerNorm's saved statistics are
never unpacked.  The gain is read in the forward hook (a sharded model has it gathered then).
``attach(bypass=True)`` also hooks the norm's input to compare the whole gradient there with the
part through the norm (:mod:`lnmonitor.core.meter.bypass`): what goes around it says whether it
reads the residual stream.  A hook never raises into the user's backward: an error stops the tap
for the step and is kept in :attr:`NormTap.error`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors, torch_internals
from lnmonitor.core.hooks import Hooks, measuring
from lnmonitor.core.maths.reductions import (
    chunk_rows,
    drop_rounding_rows,
    finish_layernorm_backward,
    finish_rows,
    forward_raw,
    layernorm_backward_raw,
    mask_rows,
    row_raw,
    stack_raw,
)
from lnmonitor.core.meter.bypass import gradient_through, on_stream_gradient
from lnmonitor.core.norms.find import NormInfo

__all__ = ["CallRecord", "NormTap", "RawCall", "StepRows", "finish_calls"]


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
    """The rows of one measured step, on one device, keyed by norm index: ``data`` ``(5, rows)``
    float32 (:data:`~lnmonitor.core.maths.reductions.FIELDS`), one :class:`CallRecord` per call in
    the order the gradients arrived; ``order``: the norms in forward order; ``bypass``: the float32
    pair ``(|dL/dx|^2, |dL/dx - J^T dL/dy|^2)`` at the input when measured, ``resolution`` its
    dtype's; ``pads``: padding rows (a device tensor); ``forward_only``: norms without gradient
    (forward statistics alone); ``calls``: measured calls (more than the fewest: reused);
    ``unmasked``: norms no row mask lined up with; ``refused``: why a ``DTensor``'s rows could not
    be read."""

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
    """Every call's rows finished (those that finish alike together), padding rows made nan and
    counted, rounding rows marked against each call's own mean: ``(rows, records in their order,
    padding rows per norm)``."""
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


@dataclass(eq=False)
class _Pending:
    """What one call's hooks hold from its forward to its backward (``x is None`` once measured)."""

    x: Tensor | None
    saved: tuple | None
    gain: Tensor | None
    keep: Tensor | None = None  # the rows that are not padding, when a row mask fits this call
    awaits_input: bool = False
    through: Tensor | None = None
    like: Tensor | None = None  # a DTensor input: its gradient is laid out as it is, then made local

    def clear(self) -> None:
        self.x = self.saved = self.gain = self.keep = self.through = self.like = None


class NormTap:
    """Hooks on ``norms`` for one measured step: ``attach()``, ``detach()`` (dropping what a
    forward without backward left), ``collect()`` (the rows since ``attach()``, then forgotten)."""

    def __init__(self, norms: Sequence[NormInfo]) -> None:
        self.norms = list(norms)
        self.error: BaseException | None = None
        # the rows of the current micro-batch that are not padding (flat bool on the device),
        # set by the meter; applied to every call whose rows it fits; or one per norm index
        self.row_mask: Tensor | dict[int, Tensor | None] | None = None
        self._hooks = Hooks()
        self._bypass_step = False
        self._calls_kept: list[RawCall] = []
        self._records: list[CallRecord] = []
        self._order: list[int] = []
        self._seen: set[int] = set()
        self._eps: dict[int, float] = {}
        self._bypass: dict[int, Tensor] = {}
        self._resolution: dict[int, float] = {}
        self._forward_only: set[int] = set()
        self._unmasked: set[int] = set()
        self._refused: dict[int, str] = {}
        self._calls: dict[int, int] = {}
        self._pending: list[_Pending] = []
        self._workspace: list[Tensor] = []

    def attach(self, bypass: bool = False) -> None:
        if self._hooks:
            return
        self._bypass_step = bypass
        for index in range(len(self.norms)):
            self._hooks.forward(self.norms[index].module, self._forward_hook(index))

    def detach(self) -> None:
        self._hooks.remove()
        for pending in self._pending:
            pending.clear()
        self._pending = []

    def _guarded(self, fn):
        """``fn`` that never raises: the first error is kept in :attr:`error`, the tap stops."""

        def hook(*args):
            if self.error is not None:
                return None
            try:
                fn(*args)
            except Exception as err:  # noqa: BLE001 - never stop the user's training
                self.error = err
            return None

        return hook

    def _forward_hook(self, index: int):
        info = self.norms[index]

        def hook(module: nn.Module, args, output) -> None:
            if not measuring():
                return  # a probe's forward, not the training step's
            if index not in self._seen:  # forward order, whatever the grad mode (see above)
                self._seen.add(index)
                self._order.append(index)
            if not (torch.is_grad_enabled() and isinstance(output, Tensor)):
                return
            if not args or not isinstance(args[0], Tensor):
                return
            stream = args[0]  # a DTensor under tensor parallelism: its local rows are measured
            refused = dtensors.unsupported(stream, output)
            if refused:
                self._refused.setdefault(index, refused)
                return
            x = dtensors.local(stream)
            packing = torch_internals.saved_tensor_hooks_active()
            if packing and torch_internals.backward_running():
                # a forward inside a backward under saved-tensor hooks: non-reentrant
                # checkpointing recomputing its region; the original call is measured (and
                # counted) and this output never receives a gradient
                return
            self._calls[index] = self._calls.get(index, 0) + 1
            if not output.requires_grad:  # frozen inputs and gain: no gradient will come
                self._forward_rows(index, info, x)
                return
            saved = None
            if not packing and info.kind == "layer" and x is stream and not dtensors.is_dtensor(output):
                saved = torch_internals.layernorm_saved_stats(output, x.numel() // max(x.shape[-1], 1))
            # the only references we hold, cleared by the backward hooks or detach()
            pending = _Pending(x, saved, info.gain(), self._keep(x, index, info), like=stream)
            self._pending.append(pending)
            if saved is not None:  # nn.LayerNorm: read what its backward computes anyway
                output.grad_fn.register_hook(self._guarded(self._node_hook(index, info, pending)))
            else:
                output.register_hook(self._guarded(self._grad_hook(index, info, pending)))
            if self._bypass_step and stream.requires_grad:
                pending.awaits_input = True
                on_stream_gradient(stream, self._guarded(self._input_hook(index, pending, x.dtype)))

        return self._guarded(hook)

    def _keep(self, x: Tensor, index: int, info: NormInfo) -> Tensor | None:
        """Norm ``index``'s row mask, one entry per row of this call (a ``(batch, tokens)`` mask
        spread over per-head rows ``(batch, tokens|heads, heads|tokens, d)``); None without one
        or when it lines up with nothing (noted in ``unmasked``)."""
        mask = self.row_mask.get(index) if isinstance(self.row_mask, dict) else self.row_mask
        if mask is None:
            return None
        d = x.shape[-1] if info.width is None else info.width
        if mask.numel() * d == x.numel():
            return mask.reshape(-1)
        if mask.ndim == 2 and x.ndim == 4 and x.shape[-1] == d and x.shape[0] == mask.shape[0]:
            batch, tokens = mask.shape
            if x.shape[1] == tokens:
                return mask[:, :, None].expand(batch, tokens, x.shape[2]).reshape(-1)
            if x.shape[2] == tokens:
                return mask[:, None, :].expand(batch, x.shape[1], tokens).reshape(-1)
        self._unmasked.add(index)
        return None

    def _forward_rows(self, index: int, info: NormInfo, x: Tensor) -> None:
        """The forward statistics of a call whose output needs no gradient (frozen)."""
        d = x.shape[-1] if info.width is None else info.width
        if x.numel() % d or d <= info.dead_dim:
            return
        self._forward_only.add(index)
        eps = info.eps(x.dtype)
        self._eps[index] = eps
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            raw = forward_raw(x.reshape(-1, d), info.kind)
        self._keep_raw(raw, ("rows", info.kind, d), self._keep(x, index, info), index, d, eps, info)

    def _take(self, pending: _Pending) -> tuple[Tensor, tuple | None, Tensor | None, Tensor | None]:
        x, saved, gain, keep = pending.x, pending.saved, pending.gain, pending.keep
        pending.x = pending.saved = pending.gain = pending.keep = None
        if not pending.awaits_input:  # else the input hook, or detach(), lets it go
            pending.like = None  # the hook keeps the pending until the graph goes: hold no tensor in it
            self._drop(pending)
        return x, saved, gain, keep

    def _drop(self, pending: _Pending) -> None:
        try:
            self._pending.remove(pending)
        except ValueError:
            pass

    def _grad_hook(self, index: int, info: NormInfo, pending: _Pending):
        def hook(grad: Tensor) -> None:
            if pending.x is None:
                return
            grad = dtensors.local(grad, pending.like)
            x, _, gain, keep = self._take(pending)
            d = x.shape[-1] if info.width is None else info.width
            if x.numel() % d or grad.shape != x.shape or d <= info.dead_dim:
                return  # not rows of this norm, or no room outside the dead subspace
            eps = info.eps(x.dtype)
            self._eps[index] = eps
            rows, grads = x.reshape(-1, d), grad.reshape(-1, d)
            args = (rows, grads, info.kind, gain, self._scratch(2, rows.shape[0], d, x.device))
            self._run(row_raw, args, ("rows", info.kind, d), keep, index, d, eps, info)
            if self._bypass_step:
                with torch.no_grad():
                    pending.through = gradient_through(rows, grads, info.kind, eps, gain)

        return hook

    def _node_hook(self, index: int, info: NormInfo, pending: _Pending):
        def hook(grad_inputs, grad_outputs) -> None:
            if pending.x is None:
                return
            x, (mean, rstd), gain, keep = self._take(pending)
            g = grad_outputs[0] if grad_outputs else None
            if g is None:
                return
            d = x.shape[-1]
            if d <= info.dead_dim or g.shape != x.shape:
                return
            eps = info.eps(x.dtype)
            self._eps[index] = eps
            dx = grad_inputs[0] if grad_inputs else None
            # the input needs no gradient, or a low-precision one (bf16, fp16: the identity below
            # subtracts nearly equal terms of |grad_input|^2, and its rounding swamps them): use x
            if dx is None or dx.shape != x.shape or dx.dtype not in (torch.float32, torch.float64):
                args = (x, g, info.kind, gain, self._scratch(2, x.numel() // d, d, x.device))
                self._run(row_raw, args, ("rows", info.kind, d), keep, index, d, eps, info)
            else:
                args = (g, dx, mean, rstd, gain, self._scratch(1, x.numel() // d, d, x.device))
                self._run(layernorm_backward_raw, args, ("layernorm", eps, d), keep, index, d, eps, info)
            if self._bypass_step and dx is not None and dx.shape == x.shape:
                pending.through = dx.detach().reshape(-1, d)  # what came through the norm, as autograd has it

        return hook

    def _input_hook(self, index: int, pending: _Pending, dtype: torch.dtype):
        """The whole gradient at the norm's input against the part through the norm."""

        def hook(total: Tensor) -> None:
            total = dtensors.local(total, pending.like)
            through = pending.through
            self._drop(pending)
            pending.clear()
            if through is None or total.numel() != through.numel():
                return
            with torch.no_grad():
                g = total.detach().reshape(through.shape).float()
                parts = torch.stack((g.square().sum(), (g - through.float()).square().sum()))
            self._bypass[index] = parts if index not in self._bypass else self._bypass[index] + parts
            resolution = max(torch.finfo(total.dtype).eps, torch.finfo(dtype).eps)
            self._resolution[index] = max(resolution, self._resolution.get(index, 0.0))

        return hook

    def _run(self, fn, args, finish: tuple, keep: Tensor | None, index: int, d: int, eps: float,
             info: NormInfo) -> None:
        device = args[0].device.type
        if torch.is_grad_enabled() or torch.is_autocast_enabled(device):
            with torch.no_grad(), torch.autocast(device, enabled=False):
                raw = fn(*args)
        else:  # the usual backward: no graph, no autocast, no context to enter
            raw = fn(*args)
        self._keep_raw(raw, finish, keep, index, d, eps, info)

    def _keep_raw(self, raw: tuple[Tensor, ...], finish: tuple, keep: Tensor | None, index: int, d: int,
                  eps: float, info: NormInfo) -> None:
        """Keep one call's raw rows until :meth:`collect` finishes them with the others."""
        self._calls_kept.append(RawCall(raw, finish, keep))
        self._records.append(CallRecord(index, raw[0].shape[0], d, eps, info.dead_dim))

    def _scratch(self, count: int, rows: int, d: int, device: torch.device) -> tuple[Tensor, ...]:
        """``count`` float32 buffers for one chunk of rows, shared by the step's norms."""
        numel = min(rows, chunk_rows(d)) * d
        ws = [b for b in self._workspace if b.device == device and b.numel() >= numel]
        while len(ws) < count:
            ws.append(torch.empty(numel, dtype=torch.float32, device=device))
        self._workspace = ws
        return tuple(ws[:count])

    def collect(self) -> StepRows:
        """The rows since :meth:`attach`, finished and forgotten (an error: kept in :attr:`error`)."""
        data, records, pads = None, [], {}
        if self.error is None:
            try:
                data, records, pads = finish_calls(self._calls_kept, self._records)
            except Exception as err:  # noqa: BLE001 - never stop the user's training
                self.error = err
        rows = StepRows(data, records, self._order, dict(self._eps), self._bypass, self._resolution,
                        pads, self._forward_only, self._calls,
                        {i for i in self._unmasked if i not in pads}, self._refused)
        self._calls_kept, self._records, self._order = [], [], []
        self._seen, self._eps, self._bypass = set(), {}, {}
        self._resolution, self._forward_only, self._calls = {}, set(), {}
        self._unmasked, self._refused = set(), {}
        self._workspace = []
        self._bypass_step = False
        return rows

