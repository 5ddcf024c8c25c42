"""Find the normalisation layers of a model and say exactly what each computes.

A module is a *candidate* norm, in this order of precedence, when

1. it declares itself: a class or instance attribute ``lnmonitor_norm_kind`` set to
   ``"layer"`` (LayerNorm-like: subtracts the mean, dead subspace span{1, xhat}) or
   ``"rms"`` (RMSNorm-like: dead subspace span{xhat}); ``None`` opts a module out;
2. its class (or a base class) was registered with :func:`register_norm`, which names the
   epsilon and says what the gain is, for classes you cannot edit;
3. it is an ``nn.LayerNorm`` or ``nn.RMSNorm``;
4. it has ``normalized_shape``, ``eps`` and ``weight`` attributes (duck typing), or it has
   no child module and its class name contains "layernorm" or "rmsnorm" (any case): the
   hand-written norms of nanoGPT, Hugging Face (``LlamaRMSNorm``, ``GemmaRMSNorm``, ...)
   and LitGPT.

Then **every** candidate is checked once against its own output: a float64 twin of the
module (:func:`lnmonitor.core.hooks.float64_twin`) runs on four designed rows and must
reproduce ``gain * xhat + bias`` of its kind to 1e-4.  A declared or
registered norm is checked as declared; for the others lnmonitor tries the kinds and the
gains ``weight``, ``1 + weight`` (Gemma, LitGPT's ``add_unit_offset``) and none, and keeps
the first that reproduces the output.  Without an epsilon attribute the epsilon is
*measured* from the output on a low-variance row (:attr:`NormInfo.eps_measured`).  A
candidate that reproduces nothing is *refused* (:attr:`Discovery.refused`, with the
measured mismatch and what to declare); nothing is ever measured with a gain or a kind
its output does not confirm.  A candidate whose ``forward`` takes more than the input it
normalises (a gate, a mask, a conditioning: Mamba2's ``MambaRMSNormGated.forward(x,
gate)`` normalises ``x * silu(gate)``) is refused too: lnmonitor measures a norm on its
first argument, which is then not what it normalises.

Rows are the input flattened to ``(-1, d)`` with ``d = prod(normalized_shape)`` (or the
gain's size, or the last dimension).  An ``eps`` of ``None`` (``nn.RMSNorm``'s default)
means ``torch.finfo(input.dtype).eps``, as torch does.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
import numbers
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from lnmonitor.core.arguments import patterns
from lnmonitor.core.geometry import dead_dim
from lnmonitor.core.hooks import float64_twin, unmeasured, unwrap, user_name
from lnmonitor.core.kinds import KINDS, NormKind

__all__ = [
    "Discovery",
    "NormInfo",
    "Refusal",
    "describe_norm",
    "discover_norms",
    "find_norms",
    "norm_eps",
    "register_norm",
    "select_norms",
    "unregister_norm",
]

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
GainFn = Callable[[nn.Module], "Tensor | None"]


@dataclass(frozen=True)
class _Spec:
    """What a norm computes: ``kind``, where its epsilon is, and its gain
    (``offset + module.<weight>``, or ``gain(module)``; no gain when both are None)."""

    kind: NormKind
    eps: str | float | None  # attribute name, fixed value, or None (dtype's machine eps)
    weight: str | None = "weight"
    offset: float = 0.0
    gain: GainFn | None = None
    eps_measured: bool = False  # no eps attribute: ``eps`` was measured from the output

    def held_gain(self, module: nn.Module) -> Tensor | None:
        """The tensor the gain is made of, as ``module`` holds it (sharded or not), without the
        offset."""
        if self.gain is not None:
            g = self.gain(module)
        else:
            g = getattr(module, self.weight, None) if self.weight else None
        return g if isinstance(g, Tensor) else None

    def gain_of(self, module: nn.Module, dtype: torch.dtype | None = None) -> Tensor | None:
        """The gain of ``module``, whole (a sharded one is gathered: a collective), in ``dtype``
        when given (the offset is added in it)."""
        g = self.held_gain(module)
        if g is None:
            return None
        g = _whole(g) if dtype is None else _gathered(g).to(dtype)
        return g + self.offset if self.offset and self.gain is None else g

    def describe(self) -> str:
        if self.gain is not None:
            gain = "gain=<callable>"
        elif self.weight is None:
            gain = "no gain"
        else:
            gain = f"gain={self.offset:g} + {self.weight}" if self.offset else f"gain={self.weight}"
        return f"{self.kind} norm, {gain}"


_REGISTRY: dict[type, _Spec] = {}
_REGISTRY_VERSION = [0]


def register_norm(
    cls: type, kind: NormKind = "layer", *, eps: str | float | None = "eps",
    weight: str | None = "weight", offset: float = 0.0, gain: GainFn | None = None,
) -> type:
    """Declare ``cls`` (and its subclasses) a normalisation layer of ``kind``.

    ``eps`` names the attribute holding the epsilon, or is the epsilon itself (a number,
    for a forward that hard-codes it, e.g. ``F.layer_norm(x, s, w, b, 1e-5)``); an
    attribute that is missing or ``None``, or ``eps=None``, means the input dtype's machine
    epsilon.  The gain is ``offset + <weight>`` (``weight`` names the attribute, ``None``:
    no gain; Gemma-style norms: ``offset=1.0``), or ``gain(module)`` when a callable is
    given.  The declaration is checked against the module's output before anything is
    measured; one that does not reproduce it is refused with the mismatch.  Returns
    ``cls``.  Registering the same class again replaces the entry.
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
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real) or not math.isfinite(offset):
        raise TypeError(f"offset must be a finite number, got {offset!r}")
    if gain is not None and not callable(gain):
        raise TypeError(f"gain must be a callable gain(module) -> Tensor or None, got {gain!r}")
    _REGISTRY[cls] = _Spec(kind, eps, weight, float(offset), gain)
    _REGISTRY_VERSION[0] += 1
    return cls


def unregister_norm(cls: type) -> None:
    """Undo :func:`register_norm` for ``cls`` (no error when it was not registered)."""
    if _REGISTRY.pop(cls, None) is not None:
        _REGISTRY_VERSION[0] += 1


# ---------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------


def _eps_attr(module: nn.Module) -> str | None:
    return next((a for a in _EPS_NAMES if getattr(module, a, None) is not None), None)


def _candidates(module: nn.Module) -> tuple[list[_Spec], bool] | None:
    """The specs to check for ``module`` (in order) and whether they were declared (then only
    that spec may be kept); None when ``module`` is not a candidate norm."""
    declared = getattr(module, "lnmonitor_norm_kind", False)
    if declared is None:
        return None
    if declared is not False:
        if declared not in KINDS:
            raise ValueError(
                f"{type(module).__name__}.lnmonitor_norm_kind must be 'layer', 'rms' or None, "
                f"got {declared!r}"
            )
        return [_Spec(declared, _eps_attr(module))], True
    for klass in type(module).__mro__:
        if klass in _REGISTRY:
            return [_REGISTRY[klass]], True
    if isinstance(module, nn.LayerNorm):
        return [_Spec("layer", "eps")], True
    if isinstance(module, nn.RMSNorm):
        return [_Spec("rms", "eps")], True
    name = type(module).__name__.lower()
    duck = all(hasattr(module, a) for a in ("normalized_shape", "eps", "weight"))
    named = ("layernorm" in name or "rmsnorm" in name) and next(module.children(), None) is None
    if not (duck or named):
        return None
    kinds = ["rms", "layer"] if "rms" in name else ["layer", "rms"]
    eps = _eps_attr(module)
    has_weight = isinstance(getattr(module, "weight", None), Tensor)
    offsets = [1.0, 0.0] if getattr(module, "add_unit_offset", False) else [0.0, 1.0]
    gains = [("weight", o) for o in offsets] if has_weight else []
    gains.append((None, 0.0))
    return [_Spec(k, eps, w, o) for k in kinds for w, o in gains], False


# ---------------------------------------------------------------------------
# the float64 check
# ---------------------------------------------------------------------------

_LOW_VAR = 1e-5  # variance (mean square) of the check row where eps shows


@dataclass(frozen=True)
class _Check:
    eps: float | None  # the epsilon the output implies (None: nothing reproduced)
    error: float  # max relative mismatch against the closed form


def _width_of(module: nn.Module, spec: _Spec) -> int | None:
    """The row width: ``prod(normalized_shape)``, else the size of the gain or weight."""
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        if isinstance(shape, int):
            return int(shape)
        try:
            return int(math.prod(int(s) for s in shape))
        except TypeError:
            pass
    for g in (spec.held_gain(module), getattr(module, "weight", None)):  # a DTensor's size is whole
        if isinstance(g, Tensor) and g.numel() > 0:
            return int(g.numel())
    return None


def _whole(t: Tensor) -> Tensor:
    """``t`` itself, or a sharded ``DTensor`` gathered, detached (a collective every rank joins:
    FSDP2 holds a norm that is its own unit sharded again when its forward hooks run)."""
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t


def _gathered(t: Tensor | None) -> Tensor | None:
    """``t`` as a plain float64 tensor (a sharded DTensor is gathered: a collective)."""
    if t is None:
        return None
    return _whole(t).detach().reshape(-1).to(torch.float64)


@torch.no_grad()
def _check(module: nn.Module, spec: _Spec, y_cache: dict) -> _Check:
    """Run the float64 twin on the four check rows (once, cached in ``y_cache``) and compare
    with the closed form of ``spec``; measure the epsilon when the module has none."""
    d = _width_of(module, spec) or 16
    gain = spec.gain_of(module, torch.float64)
    bias = _gathered(getattr(module, "bias", None) if isinstance(getattr(module, "bias", None), Tensor)
                     else None)
    if (gain is not None and gain.numel() != d) or (bias is not None and bias.numel() != d):
        return _Check(None, math.inf)
    if d < 2:  # a norm of one feature has no direction left to measure: taken as declared
        return _Check(norm_eps(module, torch.float64, spec.eps if not spec.eps_measured else None), 0.0)
    device = gain.device if gain is not None else torch.device("cpu")
    if d not in y_cache:
        z = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        z = (z - z.mean()) / z.square().mean().sub(z.mean().square()).sqrt()
        small = math.sqrt(_LOW_VAR)
        x = torch.stack((2.0 + z, 0.5 + small * z, small * z, -3.0 + 10.0 * z)).to(device)
        y = float64_twin(module)(x)
        y_cache[d] = (x, y.to(torch.float64) if isinstance(y, Tensor) and y.shape == x.shape else None)
    x, y = y_cache[d]
    if y is None:
        return _Check(None, math.inf)
    g = torch.ones(d, dtype=torch.float64, device=device) if gain is None else gain.to(device)
    b = torch.zeros_like(g) if bias is None else bias.to(device)
    c = x - x.mean(-1, keepdim=True) if spec.kind == "layer" else x
    v = c.square().mean(-1)
    # the twin runs in float64: an eps of None is float64's machine epsilon there, as in torch
    eps = _measured_eps(c, v, g, b, y, spec.kind) if spec.eps_measured else norm_eps(
        module, torch.float64, spec.eps)
    if eps is None:
        return _Check(None, math.inf)
    ref = g * c / (v + eps).sqrt().unsqueeze(-1) + b
    scale = float(ref.abs().max()) or 1.0
    error = float(((y - ref).abs() / (ref.abs() + 1e-6 * scale)).max())
    return _Check(eps if error <= 1e-4 else None, error)


def _measured_eps(c: Tensor, v: Tensor, g: Tensor, b: Tensor, y: Tensor, kind: NormKind) -> float | None:
    """The epsilon the output implies on the row whose variance (mean square) is 1e-5,
    where ``sigma^2 = 1e-5 + eps``, to 3 significant digits."""
    row = 1 if kind == "layer" else 2
    num, den = g * c[row], y[row] - b
    keep = num.abs() > 0.1 * num.abs().max()
    if not bool(keep.any()) or not bool((den[keep] != 0).all()):
        return None
    s = (num[keep] / den[keep]).median()
    eps = float(s * s - v[row])
    if not math.isfinite(eps) or eps < -1e-6 * _LOW_VAR:
        return None
    return float(f"{max(eps, 0.0):.3g}")


# ---------------------------------------------------------------------------
# the found norms
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class NormInfo:
    """A normalisation layer of a model, checked against its own output.

    ``role`` is ``None`` until the monitors know which norms read the residual stream:
    ``"residual"`` (a rung of the ladder), ``"final"`` (the last rung), ``"qk"`` (a query or
    key norm), ``"embedding"`` (the norm of the embeddings) or ``"post"`` (a norm of a branch's
    output before it is added, or post-LN of the sum after it)."""

    name: str
    module: nn.Module
    kind: NormKind
    width: int | None
    spec: _Spec = field(repr=False)
    role: str | None = None

    @property
    def dead_dim(self) -> int:
        return dead_dim(self.kind)

    @property
    def eps_measured(self) -> bool:
        """True when the module has no epsilon attribute and the check measured the
        value its forward applies (a hand-written norm found by its class name)."""
        return self.spec.eps_measured

    def gain(self) -> Tensor | None:
        """The vector that multiplies ``xhat`` (``weight``, ``1 + weight``, ...), or None."""
        return self.spec.gain_of(self.module)

    def eps(self, dtype: torch.dtype = torch.float32) -> float:
        """The epsilon the norm uses for an input of ``dtype``."""
        return norm_eps(self.module, dtype, self.spec.eps)

    def affine(self, xhat: Tensor) -> Tensor:
        """``gain * xhat + bias`` in float64 for a float64 ``xhat``: the norm's output from its
        checked form, without its rounding (the gain and bias read now: inside the model's
        forward for a sharded model)."""
        gain, bias = self.spec.gain_of(self.module, torch.float64), getattr(self.module, "bias", None)
        if gain is not None:
            xhat = xhat * gain.to(xhat.device)
        if isinstance(bias, Tensor):
            xhat = xhat + _gathered(bias).to(xhat.device)
        return xhat

    def with_role(self, role: str) -> NormInfo:
        return replace(self, role=role)


def norm_eps(
    module: nn.Module, dtype: torch.dtype = torch.float32, attr: str | float | None = None
) -> float:
    """Epsilon of a norm module; ``None`` (nn.RMSNorm's default) is ``finfo(dtype).eps``.
    ``attr`` names the attribute to read (default: the usual names), or is the value."""
    if isinstance(attr, (int, float)) and not isinstance(attr, bool):
        return float(attr)
    for name in (attr,) if attr else _EPS_NAMES:
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    return float(torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps)


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


_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (key, result)


def _identify(module: nn.Module) -> _Spec | str | None:
    """The verified spec of ``module``, a refusal reason, or None (not a candidate)."""
    found = _candidates(module)
    if found is None:
        return None
    specs, declared = found
    extra = _extra_inputs(module)
    if extra:
        return (f"its forward takes more than the input it normalises ({', '.join(extra)}): called "
                "with it, the norm normalises something else than its first argument (Mamba2's "
                "gated norm: rmsnorm(x * silu(gate))), and lnmonitor would measure the wrong tensor")
    key = (_REGISTRY_VERSION[0], tuple(specs))  # a changed declaration is checked again
    try:
        cached = _VERIFIED.get(module)
    except TypeError:  # pragma: no cover - not weak-referenceable
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    result: _Spec | str | None = None
    best: tuple[float, _Spec] | None = None
    cache: dict = {}
    failure = None
    with unmeasured():
        for spec in specs:
            # no epsilon attribute on a module found by its name: measure what it applies
            measured = spec.eps is None and not declared
            candidate = replace(spec, eps_measured=True) if measured else spec
            try:
                check = _check(module, candidate, cache)
            except Exception as err:  # noqa: BLE001 - this candidate cannot be run, try the next
                failure = failure or err
                continue
            if check.eps is not None:
                result = replace(candidate, eps=check.eps) if measured else candidate
                break
            if best is None or check.error < best[0]:
                best = (check.error, candidate)
    if result is None and best is None and failure is not None:
        result = f"its forward cannot be run on float64 rows ({type(failure).__name__}: {failure})"
    if result is None:
        error, spec = best if best is not None else (math.inf, specs[0])
        what = "as declared" if declared else "as any LayerNorm or RMSNorm of weight, 1 + weight or no gain"
        result = (
            f"its output is not reproduced {what} (closest: {spec.describe()}, max relative error "
            f"{error:.3g}); declare what it computes with register_norm({type(module).__name__}, kind, "
            "eps=..., offset=... or gain=...)"
        )
    try:
        _VERIFIED[module] = (key, result)
    except TypeError:  # pragma: no cover
        pass
    return result


def _extra_inputs(module: nn.Module) -> list[str]:
    """The named parameters of ``module.forward`` after the input it normalises."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return []
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return named[1:]


def describe_norm(module: nn.Module, name: str = "") -> NormInfo | None:
    """A :class:`NormInfo` for ``module`` if it is a normalisation layer whose output lnmonitor
    reproduces, else ``None``."""
    spec = _identify(module)
    if not isinstance(spec, _Spec):
        return None
    return NormInfo(name, module, spec.kind, _width_of(module, spec), spec)


def discover_norms(module: nn.Module) -> Discovery:
    """Every normalisation layer of ``module`` in ``named_modules()`` order, each checked against
    its own output, and the candidates refused (with the reason).  Names are the user's model's
    own, whatever wraps it (Fabric, DDP, ``torch.compile``, FSDP1: :func:`~lnmonitor.core.hooks.unwrap`,
    :func:`~lnmonitor.core.hooks.user_name`)."""
    norms, refused = [], []
    for name, sub in unwrap(module).named_modules():
        name = user_name(name)
        spec = _identify(sub)
        if isinstance(spec, _Spec):
            norms.append(NormInfo(name, sub, spec.kind, _width_of(sub, spec), spec))
        elif isinstance(spec, str):
            refused.append(Refusal(name, type(sub).__name__, spec))
    return Discovery(norms, refused)


def find_norms(module: nn.Module) -> list[NormInfo]:
    """The checked normalisation layers of ``module`` (see :func:`discover_norms`)."""
    return discover_norms(module).norms


def select_norms(
    norms: Iterable[NormInfo],
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
) -> list[NormInfo]:
    """Norms whose qualified name matches an ``include`` glob (all when ``None``) and no
    ``exclude`` glob (``fnmatch`` patterns: ``*`` matches dots too, e.g. ``"*.ln1"``)."""
    inc, exc = patterns(include, "include"), patterns(exclude, "exclude")
    out = []
    for info in norms:
        if inc is not None and not any(fnmatch.fnmatchcase(info.name, p) for p in inc):
            continue
        if exc is not None and any(fnmatch.fnmatchcase(info.name, p) for p in exc):
            continue
        out.append(info)
    return out
