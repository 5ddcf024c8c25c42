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
   ``"rms"`` when its class name contains "rms" (any case), else ``"layer"``;
5. by name, then by behaviour: a module without child modules whose class name contains
   "layernorm" or "rmsnorm" (any case) -- the hand-written norm many GPT codebases carry
   (``weight`` and optional ``bias`` parameters, ``F.layer_norm`` with a fixed eps
   inside) -- *if its forward computes* ``weight * xhat + bias`` of a LayerNorm or an
   RMSNorm (:func:`probe_norm`, on a float64 copy, once per module).  The kind is the
   one its output matches (a T5-style "LayerNorm" that does not centre is an RMSNorm);
   without an ``eps`` attribute the epsilon is *measured* from the output on a
   low-variance row (:attr:`NormInfo.eps_measured`, 3 significant digits; the monitors
   say which value they use).  A module whose output matches neither (a gain of
   ``1 + weight``, extra inputs) is not a norm to lnmonitor: register it, or leave it.

Rows are the input flattened to ``(-1, d)`` with ``d = prod(normalized_shape)`` (or the
gain's size, or the last dimension).  An ``eps`` of ``None`` (``nn.RMSNorm``'s default)
means ``torch.finfo(input.dtype).eps``, as torch does.

Tapping
-------
:class:`NormTap` registers a forward hook on each selected norm only while a step is
being measured (:meth:`NormTap.attach` / :meth:`NormTap.detach`); otherwise no hook
exists and the cost is nil.  The forward hook keeps a *reference* to the norm's input
(autograd saves that tensor for the backward anyway, so nothing is copied) and hooks
the backward; when it fires, five per-row float32 numbers (:data:`FIELDS`) are computed
on the device and the reference is dropped:

* ``var``: ``mean((x - mu)^2)`` (layer) or ``mean(x^2)`` (rms): the norm's own variance;
* ``ms``: ``mean(x^2)``, the squared rms of the stream the norm reads;
* ``sw = sum(w)``, ``ww = |w|^2`` and ``wx2v = (w . (x - mu))^2 / var`` (rms: ``w . x``),
  with ``w = gain * dL/dy``; then ``share^2 = (sw^2 [layer only] + wx2v) / (d ww)``.

For ``nn.LayerNorm`` the hook sits on its backward node and reads what that backward
has anyway -- the mean and ``1/sqrt(var + eps)`` saved in the forward, ``dL/dy`` and the
gradient it passes to its input -- so the input activation is not read again
(:func:`layernorm_backward_reductions`); other norms get a gradient hook on their
output and reduce the input (:func:`row_reductions`).  The one ``(rows, d)`` float32
temporary (``w``, and the centred input on the second path) lives in scratch buffers
shared by every norm of the step and freed by :meth:`NormTap.collect`; no
``.item()``/``.cpu()`` is called.  Forward passes without gradient (validation,
probes) are ignored.  Rows are kept as these five numbers per row until
:meth:`NormTap.collect` at the end of the step: nothing survives the step.

Activation checkpointing (``torch.utils.checkpoint``) re-runs the forward of a
checkpointed region during the backward; each norm call is still measured once.  With
``use_reentrant=True`` the original forward runs without gradient and is skipped, the
recomputation is measured; with ``use_reentrant=False`` the original forward is measured
and the recomputation (a forward inside a backward, under saved-tensor hooks) is skipped.
Under saved-tensor hooks (checkpointing, ``save_on_cpu``) the forward hook never reads a
LayerNorm's saved mean/rstd -- that would unpack them and, for checkpointing, run the
region again inside the forward -- but takes the input path.  The forward order of the
norms is recorded whatever the grad mode, so a reentrant recomputation (which runs the
blocks backwards) does not reorder the ladder.  Forward passes run inside
:func:`unmeasured` (the invariance monitor's probes) are ignored.

``torch.compile``: hooks registered after a model was compiled are not seen by the
compiled code, and hooks present while it compiles break its graph.  :func:`eager`
returns a context (``torch.compiler.set_stance("force_eager")`` where available) under
which compiled modules run their eager code; the monitors measure inside it.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
import numbers
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lnmonitor.geometry import dead_dim

__all__ = [
    "NormInfo",
    "NormTap",
    "StepRows",
    "compiled",
    "describe_norm",
    "eager",
    "find_norms",
    "norm_eps",
    "probe_norm",
    "register_norm",
    "layernorm_backward_reductions",
    "row_reductions",
    "select_norms",
    "unmeasured",
    "unregister_norm",
]

KINDS = ("layer", "rms")
_EPS_FALLBACKS = ("eps", "variance_epsilon", "epsilon")


@dataclass(frozen=True)
class _Adapter:
    kind: str
    eps: str | float | None  # attribute name, fixed value, or None (dtype's machine eps)
    weight: str | None
    eps_measured: bool = False  # no eps attribute: ``eps`` was measured by probe_norm


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


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _by_name(module: nn.Module) -> _Adapter | None:
    name = type(module).__name__.lower()
    kinds = [k for k, key in (("rms", "rmsnorm"), ("layer", "layernorm")) if key in name]
    if not kinds or next(module.children(), None) is not None:
        return None
    try:
        return _PROBED[module]
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
            eps = probe_norm(module, kind, known)
            if eps is not None:
                adapter = _Adapter(kind, attr if attr else eps, "weight", eps_measured=attr is None)
                break
    try:
        _PROBED[module] = adapter
    except TypeError:  # pragma: no cover - not weak-referenceable
        pass
    return adapter


_PROBE_VAR = 1e-5  # variance (mean square) of the probe row where eps shows


@torch.no_grad()
def probe_norm(module: nn.Module, kind: str, eps: float | None = None) -> float | None:
    """The epsilon ``module`` applies if its forward is a ``kind`` norm of its ``weight``
    (gain; absent or ``None``: none) and ``bias`` over the last dimension, else ``None``.

    A float64 copy of the module (without hooks) is run on four rows: mean 2 / var 1,
    mean 0.5 / var 1e-5, mean 0 / mean square 1e-5 and mean -3 / var 100.  ``eps``, when
    given (the module's attribute), is checked; otherwise it is measured on the row whose
    variance (LayerNorm) or mean square (RMSNorm) is 1e-5, where ``sigma^2 = 1e-5 + eps``,
    and rounded to 3 significant digits.  Then every row must match the closed form to
    1e-4 (relative).  Nothing is kept; the module itself is not run.
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
        twin = copy.deepcopy(module)
        for m in twin.modules():
            for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                          "_backward_pre_hooks"):
                if isinstance(getattr(m, hooks, None), dict):
                    getattr(m, hooks).clear()
        twin = twin.to(torch.float64)
        device = weight.device if weight is not None else torch.device("cpu")
        z = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        z = (z - z.mean()) / z.square().mean().sub(z.mean().square()).sqrt()
        small = math.sqrt(_PROBE_VAR)
        x = torch.stack((2.0 + z, 0.5 + small * z, small * z, -3.0 + 10.0 * z)).to(device)
        with unmeasured():
            y = twin(x)
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
            if not math.isfinite(eps) or eps < -1e-6 * _PROBE_VAR:
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
        """True when the module has no epsilon attribute and :func:`probe_norm` measured the
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


# ---------------------------------------------------------------------------
# per-row reductions (the hot path)
# ---------------------------------------------------------------------------

FIELDS = ("var", "ms", "sw", "ww", "wx2v")


def _buffers(workspace, n: int, d: int):
    if workspace is not None and workspace[0].numel() >= n * d:
        return workspace[0][: n * d].view(n, d), workspace[1][: n * d].view(n, d)
    return None, None


def row_reductions(
    x: Tensor,
    grad_output: Tensor,
    kind: str,
    weight: Tensor | None = None,
    workspace: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The five per-row reductions of :data:`FIELDS` as a float32 ``(5, rows)`` tensor:
    ``var`` (LayerNorm: ``mean((x-mu)^2)``; RMSNorm: ``mean(x^2)``), ``ms = mean(x^2)``,
    ``sw = sum(w)``, ``ww = |w|^2`` and ``wx2v = (w . (x - mu))^2 / var`` (RMSNorm:
    ``(w . x)^2 / var``), with ``w = weight * grad_output``.

    ``x`` and ``grad_output`` have shape ``(..., d)``; rows are all leading dimensions.
    Low-precision inputs are promoted to float32; no host synchronisation.  The two
    ``(rows, d)`` float32 temporaries (``w`` and the centred ``x``) are written into
    ``workspace`` (two flat float32 tensors of at least ``rows * d`` elements) when given,
    which spares an allocation and its page faults per call.
    """
    d = x.shape[-1]
    x = x.detach().reshape(-1, d)
    g = grad_output.detach().reshape(-1, d)
    if x.dtype != torch.float32:
        x = x.float()
    if g.dtype != torch.float32:
        g = g.float()
    buf_w, buf_x = _buffers(workspace, x.shape[0], d)
    if weight is not None:
        w = torch.mul(g, weight.detach().reshape(-1).to(torch.float32), out=buf_w)
    else:
        w = g
    sw = w.sum(dim=-1)
    ww = torch.linalg.vector_norm(w, dim=-1).square_()
    if kind == "layer":
        mu = x.sum(dim=-1).div_(d)
        xc = torch.sub(x, mu.unsqueeze(-1), out=buf_x)
        var = torch.linalg.vector_norm(xc, dim=-1).square_().div_(d)
        ms = var + mu * mu
        wx = xc.mul_(w).sum(dim=-1)
    else:
        ms = torch.linalg.vector_norm(x, dim=-1).square_().div_(d)
        var = ms
        wx = torch.mul(x, w, out=buf_x).sum(dim=-1)
    return torch.stack((var, ms, sw, ww, wx.square_().div_(var)))


def layernorm_backward_reductions(
    grad_output: Tensor,
    grad_input: Tensor,
    mean: Tensor,
    rstd: Tensor,
    eps: float,
    weight: Tensor | None = None,
    workspace: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """:func:`row_reductions` for a LayerNorm from what its backward already has, without
    reading the input again: its saved per-row ``mean`` and ``rstd = 1/sqrt(var + eps)``,
    ``grad_output = dL/dy`` and ``grad_input``, the gradient it passes to its input.

    ``var = 1/rstd^2 - eps`` (0, a constant row, below ``1e-5 eps``); and since
    ``grad_input = rstd (w - sum(w)/d - (w.xhat/d) xhat)`` with ``|xhat|^2 = d (1 - t)``,
    ``t = eps/(var + eps)``:
    ``wx2v = (d |w|^2 - sum(w)^2 - d |grad_input|^2 / rstd^2) / (1 - t^2)``.  The share is
    then exact to ~1e-7 / share (1e-4 at a share of 1e-3).
    """
    d = grad_output.shape[-1]
    g = grad_output.detach().reshape(-1, d)
    dx = grad_input.detach().reshape(-1, d)
    if g.dtype != torch.float32:
        g = g.float()
    if dx.dtype != torch.float32:
        dx = dx.float()
    buf_w, _ = _buffers(workspace, g.shape[0], d)
    rs2 = rstd.detach().reshape(-1).to(torch.float32).square()
    mu = mean.detach().reshape(-1).to(torch.float32)
    var = rs2.reciprocal().sub_(eps)
    # below ~1e-5 eps the subtraction is rounding: treat the row as constant (skipped)
    var = torch.where(var > 1e-5 * eps, var, 0.0)
    ms = var + mu * mu
    if weight is not None:
        gamma = weight.detach().reshape(-1).to(torch.float32)
        sw = torch.mv(g, gamma)
        ww = torch.linalg.vector_norm(torch.mul(g, gamma, out=buf_w), dim=-1).square_()
    else:
        sw = g.sum(dim=-1)
        ww = torch.linalg.vector_norm(g, dim=-1).square_()
    dxx = torch.linalg.vector_norm(dx, dim=-1).square_().div_(rs2)
    t = rs2.mul_(eps)  # eps / (var + eps)
    wx2v = (ww * d).sub_(sw * sw).sub_(dxx.mul_(d)).div_(1.0 - t.square_())
    return torch.stack((var, ms, sw, ww, wx2v))


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (checkpointing, ``save_on_cpu``) pack what autograd saves
    now: reading a saved tensor would then run their unpack hook."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - older torch: assume they may be
        return True
    return top(False) is not None


_QUIET = [0]


@contextlib.contextmanager
def unmeasured():
    """Forward passes run inside this context are invisible to every :class:`NormTap`
    (the invariance monitor's probe passes run in it)."""
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


def eager():
    """A context manager under which ``torch.compile``-d code runs eagerly, so that module
    hooks fire (``torch.compiler.set_stance("force_eager")``; a no-op context on a torch
    without it).  It takes effect when created and restores the previous stance on exit."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch < 2.6
        return contextlib.nullcontext()
    return set_stance("force_eager")


def compiled(module: nn.Module) -> bool:
    """Whether ``module`` is, contains or is driven by ``torch.compile``-d code that
    lnmonitor can see: an ``OptimizedModule``, ``nn.Module.compile()``, or a
    LightningModule compiled with ``torch.compile`` (Lightning's ``_compiler_ctx``)."""
    if getattr(module, "_compiler_ctx", None):
        return True
    for m in module.modules():
        if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
            return True
    return False


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
            if _QUIET[0]:
                return  # a probe's forward (lnmonitor.invariance), not the training step's
            if index not in self._seen:  # forward order, whatever the grad mode (see above)
                self._seen.add(index)
                self._order.append(index)
            if not (torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad):
                return
            if not args or not isinstance(args[0], Tensor):
                return
            x = args[0]
            packing = _saved_tensor_hooks_active()
            if packing and torch._C._current_graph_task_id() != -1:
                # a forward inside a backward under saved-tensor hooks: non-reentrant
                # checkpointing recomputing its region; the original call is measured and
                # this output never receives a gradient
                return
            saved = None if packing else _saved_stats(output, x, info)
            box = [(x, saved)]  # the only references we hold; cleared by the backward hook
            self._pending.append(box)
            if saved is not None:  # nn.LayerNorm: read what its backward computes anyway
                output.grad_fn.register_hook(self._node_hook(index, info, box))
            else:
                output.register_hook(self._grad_hook(index, info, box))

        return hook

    def _grad_hook(self, index: int, info: NormInfo, box: list):
        def hook(grad: Tensor) -> None:
            if not box:
                return
            x, _ = box.pop()
            try:
                self._pending.remove(box)
            except ValueError:
                pass
            d = x.shape[-1] if info.width is None else info.width
            if x.numel() % d or grad.shape != x.shape or d <= info.dead_dim:
                return  # not rows of this norm, or no room outside the dead subspace
            eps = info.eps(x.dtype)
            self._eps[index] = eps
            args = (
                x.reshape(-1, d), grad.reshape(-1, d), info.kind, info.weight(),
                self._scratch(x.numel(), x.device),
            )
            self._run(row_reductions, args, x.device.type, index, d, eps, info)

        return hook

    def _node_hook(self, index: int, info: NormInfo, box: list):
        def hook(grad_inputs, grad_outputs) -> None:
            if not box:
                return
            x, (mean, rstd) = box.pop()
            try:
                self._pending.remove(box)
            except ValueError:
                pass
            g = grad_outputs[0] if grad_outputs else None
            if g is None:
                return
            d = x.shape[-1]
            if d <= info.dead_dim or g.shape != x.shape:
                return
            eps = info.eps(x.dtype)
            self._eps[index] = eps
            dx = grad_inputs[0] if grad_inputs else None
            if dx is None or dx.shape != x.shape:  # the input needs no gradient: use x
                args = (x, g, info.kind, info.weight(), self._scratch(x.numel(), x.device))
                self._run(row_reductions, args, x.device.type, index, d, eps, info)
                return
            args = (g, dx, mean, rstd, eps, info.weight(), self._scratch(x.numel(), x.device))
            self._run(layernorm_backward_reductions, args, x.device.type, index, d, eps, info)

        return hook

    def _run(self, fn, args, device: str, index: int, d: int, eps: float, info: NormInfo) -> None:
        if torch.is_grad_enabled() or torch.is_autocast_enabled(device):
            with torch.no_grad(), torch.autocast(device, enabled=False):
                red = fn(*args)
        else:  # the usual backward: no graph, no autocast, no context to enter
            red = fn(*args)
        self._chunks.append(red)
        self._records.append((index, red.shape[1], d, eps, info.dead_dim))

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
