"""Which norms a monitor measures (:func:`choose_norms`), and what it tells the user about them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from lnmonitor.core.norms.find import NormInfo, Refusal, discover_norms, select_norms

__all__ = ["NormSelectionError", "choose_norms", "measured_eps_message", "no_norm_message", "refused_message"]


class NormSelectionError(ValueError):
    """The model cannot be measured as asked; the message says what to do."""


def choose_norms(model: nn.Module, include: str | Sequence[str] | None, exclude: str | Sequence[str] | None,
                 final_norm: str | None, name: str, warn: Callable[[str, str], None]) -> list[NormInfo]:
    """The selected norms of ``model``; ``warn("refused", ...)`` names the modules that look like norms
    but cannot be measured.  Raises :class:`NormSelectionError` when the model has no norm, the
    patterns select none, or ``final_norm`` is not a selected norm."""
    discovery = discover_norms(model)
    found = discovery.norms
    refused = refused_message(name, discovery.refused)
    if not found:
        raise NormSelectionError(no_norm_message(name, model) + (f" {refused}" if refused else ""))
    if refused:
        warn("refused", refused)
    selected = select_norms(found, include, exclude)
    names = [n.name for n in found]
    if not selected:
        raise NormSelectionError(
            f"{name}: include={include} exclude={exclude} select none of the {len(found)} "
            f"normalisation layers found: {', '.join(names)}. Fix the patterns (fnmatch globs "
            "over these names).")
    if final_norm is not None and final_norm not in [n.name for n in selected]:
        refusal = next((r for r in discovery.refused if r.name == final_norm), None)
        where = ("is excluded by include/exclude" if final_norm in names else
                 f"is not measured: {refusal.reason}" if refusal else "is not a norm")
        raise NormSelectionError(
            f"{name}: final_norm={final_norm!r} {where}; the selected norms are "
            f"{', '.join(n.name for n in selected)}.")
    return selected


def no_norm_message(name: str, module: nn.Module) -> str:
    """Why ``name`` cannot work on ``module``, with the module types it saw and the fix."""
    types = sorted({type(m).__name__ for m in module.modules()})
    return (
        f"{name} found no normalisation layer in {type(module).__name__} "
        f"({sum(1 for _ in module.modules())} modules of types {', '.join(types)}). "
        "It looks for nn.LayerNorm, nn.RMSNorm and modules with `normalized_shape`, `eps` and "
        "`weight` attributes; declare others with a class attribute "
        "`lnmonitor_norm_kind = 'layer'` (or 'rms') or `lnmonitor.register_norm(cls, kind)`, "
        "or remove the callback.")


def measured_eps_message(name: str, norms: Sequence[NormInfo]) -> str | None:
    """Which eps lnmonitor measured for the norms that have no eps attribute (None: none)."""
    measured = [n for n in norms if n.eps_measured]
    if not measured:
        return None
    values = sorted({n.eps() for n in measured})
    classes = sorted({type(n.module).__name__ for n in measured})
    return (
        f"{name}: {', '.join(n.name for n in measured[:4])}{', ...' if len(measured) > 4 else ''} "
        f"({', '.join(classes)}) has no eps attribute; the eps its forward applies, measured "
        f"from its output, is {', '.join(f'{e:g}' for e in values)} (used for sigma, eps/var "
        f"and the transmission). To state it instead: lnmonitor.register_norm({classes[0]}, "
        f"{measured[0].kind!r}, eps=<value>).")


def refused_message(name: str, refused: Sequence[Refusal]) -> str | None:
    """One message naming the modules that look like norms but are not measured, and why."""
    if not refused:
        return None
    by_class: dict[str, list[Refusal]] = {}
    for r in refused:
        by_class.setdefault(r.cls, []).append(r)
    parts = []
    for cls, rs in by_class.items():
        names = ", ".join(r.name for r in rs[:3]) + (", ..." if len(rs) > 3 else "")
        parts.append(f"{cls} ({len(rs)}: {names}): {rs[0].reason}")
    return (
        f"{name}: {len(refused)} module(s) look like normalisation layers but are not measured, "
        f"the rest of the model is: {'; '.join(parts)}.")
