"""The float64 check: which spec a candidate norm computes, or why it is refused.

The module's float64 forward runs on four designed rows and must reproduce ``gain * xhat + bias`` of a
candidate spec to 1e-4 (the first that does is kept; without an epsilon attribute the epsilon is
measured from a low-variance row).  A candidate that reproduces none, or whose ``forward`` takes more
than the input it normalises (Mamba2's gated norm), is refused with the reason."""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import replace

import torch
from torch import Tensor, nn

from lnmonitor.core import dtensors, zero3
from lnmonitor.core.float64 import float64_forward
from lnmonitor.core.hooks import unmeasured
from lnmonitor.core.kinds import NormKind
from lnmonitor.core.norms.registry import NormSpec, candidates, norm_eps, registry_version

__all__ = ["identify", "width_of"]

_LOW_VAR = 1e-5  # variance (mean square) of the check row where eps shows


def width_of(module: nn.Module, spec: NormSpec) -> int | None:
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


@torch.no_grad()
def _check(module: nn.Module, spec: NormSpec, y_cache: dict) -> tuple[float | None, float]:
    """The float64 forward on the check rows (cached in ``y_cache``) against ``spec``'s closed form:
    the epsilon it implies (None: not reproduced) and the max relative error."""
    d = width_of(module, spec) or 16
    gain = spec.gain_of(module, torch.float64)
    bias = getattr(module, "bias", None)
    bias = dtensors.flat64(bias) if isinstance(bias, Tensor) else None
    if (gain is not None and gain.numel() != d) or (bias is not None and bias.numel() != d):
        return None, math.inf
    if d < 2:  # a norm of one feature has no direction left to measure: taken as declared
        return norm_eps(module, torch.float64, spec.eps if not spec.eps_measured else None), 0.0
    device = gain.device if gain is not None else torch.device("cpu")
    if d not in y_cache:
        z = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        z = (z - z.mean()) / z.square().mean().sub(z.mean().square()).sqrt()
        small = math.sqrt(_LOW_VAR)
        x = torch.stack((2.0 + z, 0.5 + small * z, small * z, -3.0 + 10.0 * z)).to(device)
        y = float64_forward(module)(x)
        y_cache[d] = (x, y.to(torch.float64) if isinstance(y, Tensor) and y.shape == x.shape else None)
    x, y = y_cache[d]
    if y is None:
        return None, math.inf
    g = torch.ones(d, dtype=torch.float64, device=device) if gain is None else gain.to(device)
    b = torch.zeros_like(g) if bias is None else bias.to(device)
    c = x - x.mean(-1, keepdim=True) if spec.kind == "layer" else x
    v = c.square().mean(-1)
    # the float64 forward: an eps of None is float64's machine epsilon there, as in torch
    eps = _measured_eps(c, v, g, b, y, spec.kind) if spec.eps_measured else norm_eps(
        module, torch.float64, spec.eps)
    if eps is None:
        return None, math.inf
    ref = g * c / (v + eps).sqrt().unsqueeze(-1) + b
    scale = float(ref.abs().max()) or 1.0
    error = float(((y - ref).abs() / (ref.abs() + 1e-6 * scale)).max())
    return (eps if error <= 1e-4 else None), error


def _measured_eps(c: Tensor, v: Tensor, g: Tensor, b: Tensor, y: Tensor, kind: NormKind) -> float | None:
    """The epsilon the output implies on the row of variance 1e-5, to 3 significant digits."""
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


_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (key, result)


def identify(module: nn.Module) -> NormSpec | str | None:
    """The verified spec of ``module``, a refusal reason, or None (not a candidate)."""
    found = candidates(module)
    if found is None:
        return None
    specs, declared = found
    extra = _extra_inputs(module)
    if extra:
        return (f"its forward takes more than the input it normalises ({', '.join(extra)}): called "
                "with it, the norm normalises something else than its first argument (Mamba2's "
                "gated norm: rmsnorm(x * silu(gate))), and lnmonitor would measure the wrong tensor")
    key = (registry_version(), tuple(specs))  # a changed declaration is checked again
    try:
        cached = _VERIFIED.get(module)
    except TypeError:  # pragma: no cover - not weak-referenceable
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    result: NormSpec | str | None = None
    best: tuple[float, NormSpec] | None = None
    cache: dict = {}
    failure = None
    with unmeasured(), zero3.gathered(module):  # a ZeRO-3 norm's parameters whole: a collective
        for spec in specs:
            # no epsilon attribute on a module found by its name: measure what it applies
            measured = spec.eps is None and not declared
            candidate = replace(spec, eps_measured=True) if measured else spec
            try:
                eps, error = _check(module, candidate, cache)
            except Exception as err:  # noqa: BLE001 - this candidate cannot be run, try the next
                failure = failure or err
                continue
            if eps is not None:
                result = replace(candidate, eps=eps) if measured else candidate
                break
            if best is None or error < best[0]:
                best = (error, candidate)
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
