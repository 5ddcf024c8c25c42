"""The scales no norm governs, taken on a measured step: attention logits and output logits.

A norm bounds what it outputs, not what is made of it afterwards: the attention logits
``q . k * scale`` grow with the query and key projections (Wortsman et al. 2023, "Small-scale
proxies for large-scale Transformer training instabilities": attention-logit growth, fixed by
QK-norm), and the output logits drift with the head (their output-logit divergence, fixed by
z-loss).  :class:`ScaleTap` sees both without touching the model: while it is on (a measured
step, nothing else) a :class:`torch.overrides.TorchFunctionMode` intercepts

* every ``torch.nn.functional.scaled_dot_product_attention`` call (however the model imported
  it): the largest attention logit of the call, masked entries left out (``is_causal`` and
  boolean or ``-inf`` masks), in float32, in chunks of the batch so the scores of a long
  context never sit in memory at once;
* every ``torch.nn.functional.cross_entropy`` call: the largest output logit and the mean
  log-partition ``z = logsumexp(logits)`` over the rows with a target (``ignore_index`` rows
  left out).

Models that compute attention by hand (``softmax(q @ k.T)``) or their loss without
``cross_entropy`` give no such scale: :attr:`Scales.attention` or :attr:`Scales.logit_max`
is then empty / nan, and the reader says so.  Everything stays on the device until
:meth:`ScaleTap.result`, which reads it with one host sync.  Only forwards with gradient
outside :func:`~lnmonitor.core.hooks.unmeasured` count (a probe's pass does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lnmonitor.core.hooks import measuring

__all__ = ["ScaleTap", "Scales", "attention_logit_max", "output_logit_scales"]

# scores computed at once, at most (float32 elements): 64 MiB
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Scales:
    """One measured step's scales: ``attention``, the largest attention logit of each
    attention call in call order (one per layer in a plain forward); ``logit_max``, the largest
    output logit, and ``z_mean``, the mean log-partition of the output rows (nats), nan when
    no ``cross_entropy`` ran."""

    attention: list[float] = field(default_factory=list)
    logit_max: float = math.nan
    z_mean: float = math.nan

    @property
    def attention_max(self) -> float:
        """The largest attention logit over every layer (nan without an attention call)."""
        finite = [a for a in self.attention if math.isfinite(a)]
        return max(finite) if finite else math.nan


def attention_logit_max(q: Tensor, k: Tensor, attn_mask: Tensor | None = None,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False) -> Tensor:
    """The largest ``q . k * scale`` of one attention call over its unmasked entries, a 0-d
    float32 tensor on the device (``-inf`` when every entry is masked).  Shapes as
    ``scaled_dot_product_attention``: ``q`` (..., L, E), ``k`` (..., S, E), the mask
    broadcastable to (..., L, S)."""
    q, k = q.detach().float(), k.detach().float()
    if enable_gqa and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    length, source = q.shape[-2], k.shape[-2]
    keep = None
    if is_causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        keep = mask if keep is None else keep & mask
    shapes = [q.shape[:-2], k.shape[:-2]] + ([keep.shape[:-2]] if keep is not None else [])
    lead = torch.broadcast_shapes(*shapes)
    q = q.expand(*lead, length, q.shape[-1]).reshape(-1, length, q.shape[-1])  # (N, L, E)
    k = k.expand(*lead, source, k.shape[-1]).reshape(-1, source, k.shape[-1])  # (N, S, E)
    if keep is not None and keep.dim() > 2:
        keep = keep.expand(*lead, length, source)  # a view: chunks are copied one at a time
    rows = max(1, _CHUNK_ELEMENTS // max(length * source, 1))
    best = torch.full((), float("-inf"), device=q.device)
    for start in range(0, q.shape[0], rows):
        stop = min(start + rows, q.shape[0])
        scores = (q[start:stop] @ k[start:stop].transpose(-2, -1)) * scale  # (n, L, S)
        if keep is not None:
            part = keep
            if keep.dim() > 2:
                part = keep[torch.unravel_index(torch.arange(start, stop, device=q.device), lead)]
            scores = scores.masked_fill(~part, float("-inf"))
        best = torch.maximum(best, scores.amax())
    return best


def output_logit_scales(logits: Tensor, target: Tensor | None = None,
                        ignore_index: int = -100) -> Tensor:
    """``[largest logit, mean log-partition]`` of a ``cross_entropy`` input (classes on dim 1
    when it has two or more dimensions, as ``cross_entropy`` reads it), over the rows whose
    target is not ``ignore_index``; a float32 tensor of 2 on the device (nan with no row)."""
    logits = logits.detach().float()
    if logits.dim() >= 2:
        logits = logits.movedim(1, -1).reshape(-1, logits.shape[1])
    else:
        logits = logits.reshape(1, -1)
    if target is not None and not target.is_floating_point():
        rows = target.reshape(-1) != ignore_index
        if rows.numel() == logits.shape[0]:
            logits = logits[rows]
    if logits.shape[0] == 0:
        return torch.full((2,), math.nan, device=logits.device)
    return torch.stack([logits.amax(), logits.logsumexp(dim=-1).mean()])


class _Intercept(TorchFunctionMode):
    def __init__(self, tap: ScaleTap) -> None:
        super().__init__()
        self.tap = tap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.scaled_dot_product_attention or func is F.cross_entropy) and \
                torch.is_grad_enabled() and measuring():
            self.tap.see(func, args, kwargs)
        return func(*args, **kwargs)


class ScaleTap:
    """Intercepts attention and the loss between :meth:`start` and :meth:`stop` (see the module
    docstring); :meth:`result` reads what it saw with one host sync and forgets it."""

    def __init__(self) -> None:
        self._mode: _Intercept | None = None
        self._attention: list[Tensor] = []
        self._logits: list[Tensor] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._mode is None and self.error is None:
            self._mode = _Intercept(self)
            self._mode.__enter__()

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def see(self, func, args, kwargs) -> None:
        """Record one call's scale; a failure turns the tap off (kept in :attr:`error`),
        never the training step."""
        try:
            if func is F.scaled_dot_product_attention:
                names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
                named = dict(zip(names, args, strict=False))
                named.update(kwargs)
                self._attention.append(attention_logit_max(
                    named["query"], named["key"], named.get("attn_mask"), bool(named.get("is_causal", False)),
                    named.get("scale"), bool(named.get("enable_gqa", False))))
            else:
                names = ("input", "target", "weight", "size_average", "ignore_index")
                named = dict(zip(names, args, strict=False))
                named.update(kwargs)
                self._logits.append(output_logit_scales(
                    named["input"], named.get("target"), int(named.get("ignore_index", -100))))
        except Exception as err:  # noqa: BLE001 - a scale we cannot take must not stop training
            self.error = err
            self._attention.clear()
            self._logits.clear()

    def result(self) -> Scales | None:
        """The scales seen since the last result (None when nothing was seen), one host sync."""
        attention, self._attention = self._attention, []
        logits, self._logits = self._logits, []
        parts = [t.reshape(-1) for t in attention] + [t.to(attention[0].device) if attention else t
                                                      for t in logits]
        if not parts:
            return None
        values = [v if math.isfinite(v) else math.nan for v in torch.cat(parts).cpu().tolist()]
        n = len(attention)
        maxes, zs = values[n::2], values[n + 1::2]
        logit_max = max((m for m in maxes if m == m), default=math.nan)
        z = [v for v in zs if v == v]
        return Scales(values[:n], logit_max, sum(z) / len(z) if z else math.nan)
