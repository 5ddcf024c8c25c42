"""Layer 2: find the normalisation layers of a model and say what each one computes.

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
   ``"rms"`` when its class name contains "rms" (any case), else ``"layer"``;
5. by name, then by behaviour: a module without child modules whose class name contains
   "layernorm" or "rmsnorm" (any case) -- the hand-written norm many GPT codebases carry
   (``weight`` and optional ``bias`` parameters, ``F.layer_norm`` with a fixed eps
   inside) -- *if its forward computes* ``weight * xhat + bias`` of a LayerNorm or an
   RMSNorm (:func:`verify_norm`, on a float64 twin, once per module).  The kind is the
   one its output matches (a T5-style "LayerNorm" that does not centre is an RMSNorm);
   without an ``eps`` attribute the epsilon is *measured* from the output on a
   low-variance row (:attr:`NormInfo.eps_measured`, 3 significant digits; the monitors
   say which value they use).  A module whose output matches neither (a gain of
   ``1 + weight``, extra inputs) is not a norm to lnmonitor: register it, or leave it.

Rows are the input flattened to ``(-1, d)`` with ``d = prod(normalized_shape)`` (or the
gain's size, or the last dimension).  An ``eps`` of ``None`` (``nn.RMSNorm``'s default)
means ``torch.finfo(input.dtype).eps``, as torch does.
"""

from __future__ import annotations

import fnmatch
import math
import numbers
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lnmonitor.geometry import dead_dim
from lnmonitor.hooks import float64_twin
from lnmonitor.kinds import KINDS

__all__ = [
    "NormInfo",
    "describe_norm",
    "find_norms",
    "norm_eps",
    "register_norm",
    "select_norms",
    "unregister_norm",
    "verify_norm",
]

_EPS_FALLBACKS = ("eps", "variance_epsilon", "epsilon")


@dataclass(frozen=True)
class _Adapter:
    kind: str
    eps: str | float | None  # attribute name, fixed value, or None (dtype's machine eps)
    weight: str | None
    eps_measured: bool = False  # no eps attribute: ``eps`` was measured by verify_norm


_REGISTRY: dict[type, _Adapter] = {}


def register_norm(
    cls: type, kind: str = "layer", *, eps: str | float | None = "eps",
    weight: str | None = "weight",
) -> type:
    """Declare ``cls`` (and its subclasses) a normalisation layer of ``kind``.

    ``eps`` names the attribute holding the epsilon, or is the epsilon itself (a number,
    for a norm whose forward hard-codes it, e.g. ``F.layer_norm(x, s, w, b, 1e-5)``); an
    attribute that is missing or ``None``, or ``eps=None``, means the input dtype's machine
    epsilon.  ``weight`` names the gain attribute (``None``: no gain).  Returns ``cls`` so
    it can be used as a class decorator through ``functools.partial``.  Registering the
    same class again replaces the entry.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_norm needs an nn.Module subclass, got {cls!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    if isinstance(eps, numbers.Real) and not isinstance(eps, bool):
        eps = float(eps)
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    elif eps is not None and not (isinstance(eps, str) and eps):
        raise TypeError(f"eps must be an attribute name, a number or None, got {eps!r}")
    if weight is not None and not (isinstance(weight, str) and weight):
        raise TypeError(f"weight must be an attribute name or None, got {weight!r}")
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
    return _by_name(module)


_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _by_name(module: nn.Module) -> _Adapter | None:
    name = type(module).__name__.lower()
    kinds = [k for k, key in (("rms", "rmsnorm"), ("layer", "layernorm")) if key in name]
    if not kinds or next(module.children(), None) is not None:
        return None
    try:
        return _VERIFIED[module]
    except (KeyError, TypeError):
        pass
    kinds += [k for k in KINDS if k not in kinds]
    attr = next((a for a in _EPS_FALLBACKS if getattr(module, a, None) is not None), None)
    adapter = None
    try:
        known = None if attr is None else float(getattr(module, attr))
    except (TypeError, ValueError):
        known = None
    if attr is None or known is not None:
        for kind in kinds:
            eps = verify_norm(module, kind, known)
            if eps is not None:
                adapter = _Adapter(kind, attr if attr else eps, "weight", eps_measured=attr is None)
                break
    try:
        _VERIFIED[module] = adapter
    except TypeError:  # pragma: no cover - not weak-referenceable
        pass
    return adapter


_LOW_VAR = 1e-5  # variance (mean square) of the check row where eps shows


@torch.no_grad()
def verify_norm(module: nn.Module, kind: str, eps: float | None = None) -> float | None:
    """The epsilon ``module`` applies if its forward is a ``kind`` norm of its ``weight``
    (gain; absent or ``None``: none) and ``bias`` over the last dimension, else ``None``.

    A float64 twin of the module (:func:`lnmonitor.hooks.float64_twin`) is run on four
    rows: mean 2 / var 1, mean 0.5 / var 1e-5, mean 0 / mean square 1e-5 and mean -3 /
    var 100.  ``eps``, when given (the module's attribute), is checked; otherwise it is
    measured on the row whose variance (LayerNorm) or mean square (RMSNorm) is 1e-5, where
    ``sigma^2 = 1e-5 + eps``, and rounded to 3 significant digits.  Then every row must
    match the closed form to 1e-4 (relative).  The module itself is not run.
    """
    weight = getattr(module, "weight", None)
    weight = weight if isinstance(weight, Tensor) else None
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, Tensor) else None
    if weight is not None:
        d = weight.numel()
    else:
        shape = getattr(module, "normalized_shape", None)
        d = int(math.prod(shape)) if isinstance(shape, (tuple, list)) else (
            int(shape) if isinstance(shape, int) else 16)
    if d < 3 or (bias is not None and bias.numel() != d):
        return None
    try:
        device = weight.device if weight is not None else torch.device("cpu")
        z = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        z = (z - z.mean()) / z.square().mean().sub(z.mean().square()).sqrt()
        small = math.sqrt(_LOW_VAR)
        x = torch.stack((2.0 + z, 0.5 + small * z, small * z, -3.0 + 10.0 * z)).to(device)
        y = float64_twin(module)(x)
        if not isinstance(y, Tensor) or y.shape != x.shape:
            return None
        y = y.to(torch.float64)
        g = torch.ones(d, dtype=torch.float64, device=device) if weight is None else (
            weight.detach().reshape(-1).to(device, torch.float64))
        b = torch.zeros_like(g) if bias is None else bias.detach().reshape(-1).to(device, torch.float64)
        c = x - x.mean(-1, keepdim=True) if kind == "layer" else x
        v = c.square().mean(-1)
        if eps is None:
            row = 1 if kind == "layer" else 2
            num, den = g * c[row], y[row] - b
            keep = num.abs() > 0.1 * num.abs().max()
            if not bool(keep.any()) or not bool((den[keep] != 0).all()):
                return None
            s = (num[keep] / den[keep]).median()
            eps = float(s * s - v[row])
            if not math.isfinite(eps) or eps < -1e-6 * _LOW_VAR:
                return None
            eps = float(f"{max(eps, 0.0):.3g}")
        ref = g * c / (v + eps).sqrt().unsqueeze(-1) + b
        if torch.allclose(y, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max())):
            return eps
    except Exception:  # noqa: BLE001 - a module we cannot run this way is not one we know
        return None
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

    @property
    def eps_measured(self) -> bool:
        """True when the module has no epsilon attribute and :func:`verify_norm` measured the
        value its forward applies (a hand-written norm found by its class name)."""
        return self.adapter.eps_measured

    def weight(self) -> Tensor | None:
        if self.adapter.weight is None:
            return None
        w = getattr(self.module, self.adapter.weight, None)
        return w if isinstance(w, Tensor) else None

    def eps(self, dtype: torch.dtype = torch.float32) -> float:
        """The epsilon the norm uses for an input of ``dtype``."""
        return norm_eps(self.module, dtype, self.adapter.eps)


def norm_eps(
    module: nn.Module, dtype: torch.dtype = torch.float32, attr: str | float | None = None
) -> float:
    """Epsilon of a norm module; ``None`` (nn.RMSNorm's default) is ``finfo(dtype).eps``.
    ``attr`` names the attribute to read (default: the usual names), or is the value."""
    if isinstance(attr, (int, float)) and not isinstance(attr, bool):
        return float(attr)
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
