"""Layer 2: find the normalisation layers of a model and tap them on measured steps.

Discovery
---------
:func:`find_norms` walks ``module.named_modules()`` and keeps every module that is a
normalisation layer, in this order of precedence:

1. the module declares itself: a class or instance attribute ``lnmonitor_norm_kind``
   set to ``"layer"`` (LayerNorm-like: subtracts the mean, dead subspace span{1, xhat})
   or ``"rms"`` (RMSNorm-like: dead subspace span{xhat}); ``None`` opts a module out.
   Its epsilon is read from ``eps`` (or ``variance_epsilon``/``epsilon``) and its gain
   from ``weight`` (may be ``None``);
2. its class (or a base class) was registered with :func:`register_norm`, which also
   names the epsilon and gain attributes, for classes you cannot edit, e.g.
   ``register_norm(LlamaRMSNorm, "rms", eps="variance_epsilon")``;
3. ``nn.LayerNorm`` (``"layer"``) and ``nn.RMSNorm`` (``"rms"``);
4. duck typing: any module with ``normalized_shape``, ``eps`` and ``weight`` attributes,
   ``"rms"`` when its class name contains "rms" (any case), else ``"layer"``.

Rows are the input flattened to ``(-1, d)`` with ``d = prod(normalized_shape)`` (or the
gain's size, or the last dimension).  An ``eps`` of ``None`` (``nn.RMSNorm``'s default)
means ``torch.finfo(input.dtype).eps``, as torch does.

Tapping
-------
:class:`NormTap` registers a forward hook on each selected norm only while a step is
being measured (:meth:`NormTap.attach` / :meth:`NormTap.detach`); otherwise no hook
exists and the cost is nil.  The forward hook keeps a *reference* to the norm's input
(autograd saves that tensor for the backward anyway, so nothing is copied) -- and, for
``nn.LayerNorm``, to the per-row mean and ``1/sqrt(var + eps)`` that
``native_layer_norm`` saved for its backward, so the input need not be reduced again
-- and puts a gradient hook on the output.  When the gradient ``dL/dy`` arrives, five per-row float32
reductions are computed on the device and the reference is dropped:

* ``var``: ``mean((x - mu)^2)`` (layer) or ``mean(x^2)`` (rms): the norm's own variance;
* ``ms``: ``mean(x^2)``, the squared rms of the stream the norm reads;
* ``sw = sum(w)``, ``ww = |w|^2``, ``wx = w . (x - mu)`` (layer) or ``w . x`` (rms),
  with ``w = gain * dL/dy``.

From these, ``share^2 = (sw^2/d [layer only] + wx^2 / (d var)) / ww`` (DESIGN.md 1:
``u1 = 1/sqrt(d)``, ``u2 = (x - mu)/|x - mu|``, ``|x - mu|^2 = d var``).  The two
``(rows, d)`` float32 temporaries (``w`` and the centred ``x``) live in two scratch
buffers allocated at the first gradient of the step and shared by every norm (freed by
:meth:`NormTap.collect`); no ``.item()``/``.cpu()`` is called.  Forward passes without gradient (validation,
probes) are ignored.  Rows are kept as these five numbers per row until
:meth:`NormTap.collect` at the end of the step: nothing survives the step.

Activation checkpointing re-runs the forward; a norm inside a checkpointed region is
then measured twice for that micro-batch.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lnmonitor.geometry import dead_dim

__all__ = [
    "NormInfo",
    "NormTap",
    "StepRows",
    "describe_norm",
    "find_norms",
    "norm_eps",
    "register_norm",
    "row_reductions",
    "select_norms",
    "unregister_norm",
]

KINDS = ("layer", "rms")
_EPS_FALLBACKS = ("eps", "variance_epsilon", "epsilon")


@dataclass(frozen=True)
class _Adapter:
    kind: str
    eps: str | None
    weight: str | None


_REGISTRY: dict[type, _Adapter] = {}


def register_norm(
    cls: type, kind: str = "layer", *, eps: str | None = "eps", weight: str | None = "weight"
) -> type:
    """Declare ``cls`` (and its subclasses) a normalisation layer of ``kind``.

    ``eps`` and ``weight`` name the attributes holding the epsilon and the gain (``None``:
    no gain; an epsilon attribute that is missing or ``None`` means the input dtype's
    machine epsilon).  Returns ``cls`` so it can be used as a class decorator through
    ``functools.partial``.  Registering the same class again replaces the entry.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_norm needs an nn.Module subclass, got {cls!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    _REGISTRY[cls] = _Adapter(kind, eps, weight)
    return cls


def unregister_norm(cls: type) -> None:
    """Undo :func:`register_norm` for ``cls`` (no error when it was not registered)."""
    _REGISTRY.pop(cls, None)


def _adapter(module: nn.Module) -> _Adapter | None:
    declared = getattr(module, "lnmonitor_norm_kind", False)
    if declared is None:
        return None
    if declared is not False:
        if declared not in KINDS:
            raise ValueError(
                f"{type(module).__name__}.lnmonitor_norm_kind must be 'layer', 'rms' or None, "
                f"got {declared!r}"
            )
        eps = next((a for a in _EPS_FALLBACKS if hasattr(module, a)), None)
        return _Adapter(declared, eps, "weight")
    for klass in type(module).__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass]
    if isinstance(module, nn.LayerNorm):
        return _Adapter("layer", "eps", "weight")
    if isinstance(module, nn.RMSNorm):
        return _Adapter("rms", "eps", "weight")
    if all(hasattr(module, a) for a in ("normalized_shape", "eps", "weight")):
        kind = "rms" if "rms" in type(module).__name__.lower() else "layer"
        return _Adapter(kind, "eps", "weight")
    return None


@dataclass(frozen=True, eq=False)
class NormInfo:
    """A normalisation layer found in a model."""

    name: str
    module: nn.Module
    kind: str
    width: int | None
    adapter: _Adapter = field(repr=False)

    @property
    def dead_dim(self) -> int:
        return dead_dim(self.kind)

    def weight(self) -> Tensor | None:
        if self.adapter.weight is None:
            return None
        w = getattr(self.module, self.adapter.weight, None)
        return w if isinstance(w, Tensor) else None

    def eps(self, dtype: torch.dtype = torch.float32) -> float:
        """The epsilon the norm uses for an input of ``dtype``."""
        return norm_eps(self.module, dtype, self.adapter.eps)


def norm_eps(module: nn.Module, dtype: torch.dtype = torch.float32, attr: str | None = None) -> float:
    """Epsilon of a norm module; ``None`` (nn.RMSNorm's default) is ``finfo(dtype).eps``."""
    names = (attr,) if attr else _EPS_FALLBACKS
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    return float(torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps)


def _width(module: nn.Module, adapter: _Adapter) -> int | None:
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        if isinstance(shape, int):
            return int(shape)
        try:
            return int(math.prod(int(s) for s in shape))
        except TypeError:
            pass
    if adapter.weight is not None:
        w = getattr(module, adapter.weight, None)
        if isinstance(w, Tensor) and w.numel() > 0:
            return int(w.numel())
    return None


def describe_norm(module: nn.Module, name: str = "") -> NormInfo | None:
    """A :class:`NormInfo` for ``module`` if it is a normalisation layer, else ``None``."""
    adapter = _adapter(module)
    if adapter is None:
        return None
    return NormInfo(name, module, adapter.kind, _width(module, adapter), adapter)


def find_norms(module: nn.Module) -> list[NormInfo]:
    """Every normalisation layer of ``module`` in ``named_modules()`` order."""
    found = []
    for name, sub in module.named_modules():
        info = describe_norm(sub, name)
        if info is not None:
            found.append(info)
    return found


def _patterns(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def select_norms(
    norms: Iterable[NormInfo],
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
) -> list[NormInfo]:
    """Norms whose qualified name matches an ``include`` glob (all when ``None``) and no
    ``exclude`` glob (``fnmatch`` patterns: ``*`` matches dots too, e.g. ``"*.ln1"``)."""
    inc, exc = _patterns(include), _patterns(exclude)
    out = []
    for info in norms:
        if inc is not None and not any(fnmatch.fnmatchcase(info.name, p) for p in inc):
            continue
        if exc is not None and any(fnmatch.fnmatchcase(info.name, p) for p in exc):
            continue
        out.append(info)
    return out


# ---------------------------------------------------------------------------
# per-row reductions (the hot path)
# ---------------------------------------------------------------------------

FIELDS = ("var", "ms", "sw", "ww", "wx")


def row_reductions(
    x: Tensor,
    grad_output: Tensor,
    kind: str,
    weight: Tensor | None = None,
    workspace: tuple[Tensor, Tensor] | None = None,
    saved: tuple[Tensor, Tensor, float] | None = None,
) -> Tensor:
    """The five per-row reductions of :data:`FIELDS` as a float32 ``(5, rows)`` tensor.

    ``x`` and ``grad_output`` have shape ``(..., d)``; rows are all leading dimensions.
    Low-precision inputs are promoted to float32; no host synchronisation.  The two
    ``(rows, d)`` float32 temporaries (``w`` and the centred ``x``) are written into
    ``workspace`` (two flat float32 tensors of at least ``rows * d`` elements) when given,
    which spares an allocation and its page faults per call.

    ``saved = (mean, rstd, eps)``: a LayerNorm's own per-row mean and ``1/sqrt(var + eps)``
    (what ``native_layer_norm`` saves for its backward); then ``x`` is not re-reduced:
    ``var = 1/rstd^2 - eps`` (relative error ~1e-7 (1 + eps/var)) and ``w . (x - mu) =
    w . x - mu sum(w)`` (relative error ~1e-7 sqrt(1 + mu^2/var) / share).
    """
    d = x.shape[-1]
    x = x.detach().reshape(-1, d)
    g = grad_output.detach().reshape(-1, d)
    if x.dtype != torch.float32:
        x = x.float()
    if g.dtype != torch.float32:
        g = g.float()
    n = x.shape[0]
    if workspace is not None and workspace[0].numel() >= n * d:
        buf_w, buf_x = (t[: n * d].view(n, d) for t in workspace)
    else:
        buf_w = buf_x = None
    if weight is not None:
        w = torch.mul(g, weight.detach().reshape(-1).to(torch.float32), out=buf_w)
    else:
        w = g
    sw = w.sum(dim=-1)
    ww = torch.linalg.vector_norm(w, dim=-1).square_()
    if kind == "layer" and saved is not None:
        mean, rstd, eps = saved
        mu = mean.detach().reshape(-1).to(torch.float32)
        var = rstd.detach().reshape(-1).to(torch.float32).square().reciprocal_().sub_(eps)
        ms = var + mu * mu
        wx = torch.mul(x, w, out=buf_x).sum(dim=-1).sub_(mu * sw)
    elif kind == "layer":
        mu = x.sum(dim=-1).div_(d)
        xc = torch.sub(x, mu.unsqueeze(-1), out=buf_x)
        var = torch.linalg.vector_norm(xc, dim=-1).square_().div_(d)
        ms = var + mu * mu
        wx = xc.mul_(w).sum(dim=-1)
    else:
        ms = torch.linalg.vector_norm(x, dim=-1).square_().div_(d)
        var = ms
        wx = torch.mul(x, w, out=buf_x).sum(dim=-1)
    return torch.stack((var, ms, sw, ww, wx))


@dataclass
class StepRows:
    """Per-row reductions gathered during one measured step (all on one device).

    ``data`` is ``(5, rows)`` float32 (:data:`FIELDS`), ``records`` lists, per hooked
    call, ``(norm index, rows, d, eps, dead_dim)`` in the order the gradients arrived.
    ``order`` holds the norm indices in the order their forward first ran.
    """

    data: Tensor | None
    records: list[tuple[int, int, int, float, int]]
    order: list[int]
    eps: dict[int, float]


def _saved_stats(output: Tensor, x: Tensor, info: NormInfo) -> tuple[Tensor, Tensor] | None:
    """The per-row mean and rstd that ``native_layer_norm`` saved for its backward, when
    ``output`` came straight from it over the last dimension (else None)."""
    if info.kind != "layer":
        return None
    fn = output.grad_fn
    if fn is None or fn.name() != "NativeLayerNormBackward0":
        return None
    try:
        if len(fn._saved_normalized_shape) != 1:
            return None
        mean, rstd = fn._saved_result1, fn._saved_result2
    except (AttributeError, RuntimeError):
        return None
    rows = x.numel() // max(x.shape[-1], 1)
    if mean.numel() != rows or rstd.numel() != rows:
        return None
    return mean, rstd


class NormTap:
    """Hooks on ``norms`` for the duration of one measured step.

    ``attach()`` registers one forward hook per norm; ``detach()`` removes them (and
    drops whatever a forward without backward left behind); ``collect()`` hands over
    the rows measured since ``attach()`` and forgets them.
    """

    def __init__(self, norms: Sequence[NormInfo]) -> None:
        self.norms = list(norms)
        self._handles: list = []
        self._chunks: list[Tensor] = []
        self._records: list[tuple[int, int, int, float, int]] = []
        self._order: list[int] = []
        self._seen: set[int] = set()
        self._eps: dict[int, float] = {}
        self._pending: list[list] = []
        self._workspace: tuple[Tensor, Tensor] | None = None

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        if self._handles:
            return
        for index, info in enumerate(self.norms):
            self._handles.append(info.module.register_forward_hook(self._forward_hook(index)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for box in self._pending:
            box.clear()
        self._pending = []

    def _forward_hook(self, index: int):
        info = self.norms[index]

        def hook(module: nn.Module, args, output) -> None:
            if not (torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad):
                return
            if not args or not isinstance(args[0], Tensor):
                return
            x = args[0]
            if index not in self._seen:
                self._seen.add(index)
                self._order.append(index)
            box = [(x, _saved_stats(output, x, info))]  # cleared when the gradient arrives
            self._pending.append(box)
            output.register_hook(self._grad_hook(index, info, box))

        return hook

    def _grad_hook(self, index: int, info: NormInfo, box: list):
        def hook(grad: Tensor) -> None:
            if not box:
                return
            x, saved = box.pop()
            try:
                self._pending.remove(box)
            except ValueError:
                pass
            d = x.shape[-1] if info.width is None else info.width
            if x.numel() % d or grad.shape != x.shape or d <= info.dead_dim:
                return  # not rows of this norm, or no room outside the dead subspace
            eps = info.eps(x.dtype)
            self._eps[index] = eps
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                red = row_reductions(
                    x.reshape(-1, d), grad.reshape(-1, d), info.kind, info.weight(),
                    self._scratch(x.numel(), x.device),
                    None if saved is None else (*saved, eps),
                )
            self._chunks.append(red)
            self._records.append((index, red.shape[1], d, eps, info.dead_dim))

        return hook

    def _scratch(self, numel: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Two flat float32 buffers reused by every norm of the step (freed by collect)."""
        ws = self._workspace
        if ws is None or ws[0].numel() < numel or ws[0].device != device:
            ws = tuple(torch.empty(numel, dtype=torch.float32, device=device) for _ in range(2))
            self._workspace = ws
        return ws

    def collect(self) -> StepRows:
        data = None
        if self._chunks:
            data = self._chunks[0] if len(self._chunks) == 1 else torch.cat(self._chunks, dim=1)
        rows = StepRows(data, self._records, self._order, dict(self._eps))
        self._chunks, self._records, self._order = [], [], []
        self._seen, self._eps = set(), {}
        self._workspace = None
        return rows
