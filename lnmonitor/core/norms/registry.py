"""What a normalisation layer computes (:class:`NormSpec`), and which modules may be one.

A module is a candidate norm, in this order: it declares ``lnmonitor_norm_kind = "layer"`` or
``"rms"`` (``None`` opts out); its class was given to :func:`register_norm`; it is an ``nn.LayerNorm``
or ``nn.RMSNorm``; it has ``normalized_shape``, ``eps`` and ``weight``, or no child and a class name
containing "layernorm" or "rmsnorm" (any case).  An ``eps`` of None means ``finfo(dtype).eps``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors
from lnmonitor.core.kinds import NORM_KINDS, NormKind

__all__ = [
    "GainFn", "NormSpec", "candidates", "norm_eps", "register_norm", "registry_version", "unregister_norm",
]

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
GainFn = Callable[[nn.Module], "Tensor | None"]


@dataclass(frozen=True)
class NormSpec:
    """What a norm computes: ``kind``, its epsilon, and its gain (``offset + module.<weight>``, or
    ``gain(module)``; none when both are None)."""

    kind: NormKind
    eps: str | float | None  # attribute name, fixed value, or None (dtype's machine eps)
    weight: str | None = "weight"
    offset: float = 0.0
    gain: GainFn | None = None
    eps_measured: bool = False  # no eps attribute: ``eps`` was measured from the output

    def held_gain(self, module: nn.Module) -> Tensor | None:
        """The tensor the gain is made of, as ``module`` holds it (sharded or not), without the offset."""
        if self.gain is not None:
            g = self.gain(module)
        else:
            g = getattr(module, self.weight, None) if self.weight else None
        return g if isinstance(g, Tensor) else None

    def gain_of(self, module: nn.Module, dtype: torch.dtype | None = None) -> Tensor | None:
        """The gain of ``module``, whole (a sharded one gathered: a collective), in ``dtype`` when given."""
        g = self.held_gain(module)
        if g is None:
            return None
        g = dtensors.unsharded(g) if dtype is None else dtensors.flat64(g).to(dtype)
        return g + self.offset if self.offset and self.gain is None else g

    def describe(self) -> str:
        if self.gain is not None:
            gain = "gain=<callable>"
        elif self.weight is None:
            gain = "no gain"
        else:
            gain = f"gain={self.offset:g} + {self.weight}" if self.offset else f"gain={self.weight}"
        return f"{self.kind} norm, {gain}"


_REGISTRY: dict[type, NormSpec] = {}
_REGISTRY_VERSION = [0]


def register_norm(cls: type, kind: NormKind = "layer", *, eps: str | float | None = "eps",
                  weight: str | None = "weight", offset: float = 0.0, gain: GainFn | None = None) -> type:
    """Declare ``cls`` (and its subclasses) a normalisation layer of ``kind``; returns ``cls``.

    ``eps`` names the epsilon's attribute or is the epsilon (a forward that hard-codes it); missing,
    ``None`` or ``eps=None`` means the input dtype's machine epsilon.  The gain is ``offset + <weight>``
    (``weight=None``: no gain; Gemma: ``offset=1.0``), or ``gain(module)``.  The declaration is checked
    against the module's output and refused with the mismatch when it does not reproduce it.
    Registering a class again replaces its entry.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_norm needs an nn.Module subclass, got {cls!r}")
    if kind not in NORM_KINDS:
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    if isinstance(eps, numbers.Real) and not isinstance(eps, bool):
        eps = float(eps)
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    elif eps is not None and not (isinstance(eps, str) and eps):
        raise TypeError(f"eps must be an attribute name, a number or None, got {eps!r}")
    if weight is not None and not (isinstance(weight, str) and weight):
        raise TypeError(f"weight must be an attribute name or None, got {weight!r}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real) or not math.isfinite(offset):
        raise TypeError(f"offset must be a finite number, got {offset!r}")
    if gain is not None and not callable(gain):
        raise TypeError(f"gain must be a callable gain(module) -> Tensor or None, got {gain!r}")
    _REGISTRY[cls] = NormSpec(kind, eps, weight, float(offset), gain)
    _REGISTRY_VERSION[0] += 1
    return cls


def unregister_norm(cls: type) -> None:
    """Undo :func:`register_norm` for ``cls`` (no error when it was not registered)."""
    if _REGISTRY.pop(cls, None) is not None:
        _REGISTRY_VERSION[0] += 1


def registry_version() -> int:
    """A number that changes with the registry (a module checked before must be checked again)."""
    return _REGISTRY_VERSION[0]


def _eps_attr(module: nn.Module) -> str | None:
    return next((a for a in _EPS_NAMES if getattr(module, a, None) is not None), None)


def candidates(module: nn.Module) -> tuple[list[NormSpec], bool] | None:
    """The specs to check for ``module``, in order, and whether they were declared (then only that
    spec may be kept); None when ``module`` is not a candidate."""
    declared = getattr(module, "lnmonitor_norm_kind", False)
    if declared is None:
        return None
    if declared is not False:
        if declared not in NORM_KINDS:
            raise ValueError(f"{type(module).__name__}.lnmonitor_norm_kind must be 'layer', 'rms' or None, "
                             f"got {declared!r}")
        return [NormSpec(declared, _eps_attr(module))], True
    for klass in type(module).__mro__:
        if klass in _REGISTRY:
            return [_REGISTRY[klass]], True
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return [NormSpec("layer" if isinstance(module, nn.LayerNorm) else "rms", "eps")], True
    name = type(module).__name__.lower()
    duck = all(hasattr(module, a) for a in ("normalized_shape", "eps", "weight"))
    named = ("layernorm" in name or "rmsnorm" in name) and next(module.children(), None) is None
    if not (duck or named):
        return None
    kinds = ["rms", "layer"] if "rms" in name else ["layer", "rms"]
    eps = _eps_attr(module)
    offsets = [1.0, 0.0] if getattr(module, "add_unit_offset", False) else [0.0, 1.0]
    gains = [("weight", o) for o in offsets] if isinstance(getattr(module, "weight", None), Tensor) else []
    return [NormSpec(k, eps, w, o) for k in kinds for w, o in [*gains, (None, 0.0)]], False


def norm_eps(module: nn.Module, dtype: torch.dtype = torch.float32, attr: str | float | None = None) -> float:
    """Epsilon of a norm module (``attr``: its attribute, default the usual names, or the value); None
    (nn.RMSNorm's default) is ``finfo(dtype).eps``."""
    if isinstance(attr, (int, float)) and not isinstance(attr, bool):
        return float(attr)
    for name in (attr,) if attr else _EPS_NAMES:
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    return float(torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps)
