"""The normalisation layers of a model, each checked against its own output (:func:`discover_norms`),
and those an ``include``/``exclude`` glob selects (:func:`select_norms`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors
from lnmonitor.core.kinds import NormKind
from lnmonitor.core.maths.geometry import dead_dim
from lnmonitor.core.monitor.arguments import patterns
from lnmonitor.core.norms.identify import identify, width_of
from lnmonitor.core.norms.registry import NormSpec, norm_eps
from lnmonitor.core.wrappers import unwrap, user_name

__all__ = [
    "Discovery", "NormInfo", "Refusal", "describe_norm", "discover_norms", "find_norms", "select_norms",
]


@dataclass(frozen=True, eq=False)
class NormInfo:
    """A normalisation layer of a model, checked against its own output; ``role``
    (:mod:`~lnmonitor.core.norms.roles`) is None until known."""

    name: str
    module: nn.Module
    kind: NormKind
    width: int | None
    spec: NormSpec = field(repr=False)
    role: str | None = None

    @property
    def dead_dim(self) -> int:
        return dead_dim(self.kind)

    @property
    def eps_measured(self) -> bool:
        """Whether the check measured the epsilon its forward applies (no epsilon attribute)."""
        return self.spec.eps_measured

    def gain(self) -> Tensor | None:
        """The vector that multiplies ``xhat`` (``weight``, ``1 + weight``, ...), or None."""
        return self.spec.gain_of(self.module)

    def eps(self, dtype: torch.dtype = torch.float32) -> float:
        """The epsilon the norm uses for an input of ``dtype``."""
        return norm_eps(self.module, dtype, self.spec.eps)

    def affine(self, xhat: Tensor) -> Tensor:
        """``gain * xhat + bias`` in float64 for a float64 ``xhat``: the norm's output without rounding."""
        gain, bias = self.spec.gain_of(self.module, torch.float64), getattr(self.module, "bias", None)
        if gain is not None:
            xhat = xhat * gain.to(xhat.device)
        if isinstance(bias, Tensor):
            xhat = xhat + dtensors.flat64(bias).to(xhat.device)
        return xhat

    def with_role(self, role: str) -> NormInfo:
        return replace(self, role=role)


@dataclass(frozen=True)
class Refusal:
    """A module that looks like a norm but whose output lnmonitor cannot reproduce."""

    name: str
    cls: str
    reason: str


@dataclass
class Discovery:
    """The norms of a model (checked, in ``named_modules()`` order) and the refused ones."""

    norms: list[NormInfo]
    refused: list[Refusal]


def describe_norm(module: nn.Module, name: str = "") -> NormInfo | None:
    """A :class:`NormInfo` for ``module`` if it is a norm whose output lnmonitor reproduces, else None."""
    spec = identify(module)
    if not isinstance(spec, NormSpec):
        return None
    return NormInfo(name, module, spec.kind, width_of(module, spec), spec)


def discover_norms(module: nn.Module) -> Discovery:
    """Every norm of ``module`` in ``named_modules()`` order, checked against its own output, and the
    candidates refused (with why); names are the user's model's own, whatever wraps it."""
    norms, refused = [], []
    for name, sub in unwrap(module).named_modules():
        name = user_name(name)
        spec = identify(sub)
        if isinstance(spec, NormSpec):
            norms.append(NormInfo(name, sub, spec.kind, width_of(sub, spec), spec))
        elif isinstance(spec, str):
            refused.append(Refusal(name, type(sub).__name__, spec))
    return Discovery(norms, refused)


def find_norms(module: nn.Module) -> list[NormInfo]:
    """The checked normalisation layers of ``module`` (see :func:`discover_norms`)."""
    return discover_norms(module).norms


def select_norms(norms: Iterable[NormInfo], include: str | Sequence[str] | None = None,
                 exclude: str | Sequence[str] | None = None) -> list[NormInfo]:
    """Norms whose name matches an ``include`` glob (all when None) and no ``exclude`` glob
    (``fnmatch``: ``*`` matches dots too, e.g. ``"*.ln1"``)."""
    inc, exc = patterns(include, "include"), patterns(exclude, "exclude")
    return [info for info in norms if (inc is None or any(fnmatch.fnmatchcase(info.name, p) for p in inc))
            and not any(fnmatch.fnmatchcase(info.name, p) for p in exc or ())]
