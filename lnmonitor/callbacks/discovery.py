"""What the callbacks tell the user about the normalisation layers they found."""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lnmonitor.norms import NormInfo, Refusal


def no_norm_message(owner: str, module: nn.Module) -> str:
    """Why ``owner`` cannot work on ``module``, with the module types it saw and the fix."""
    types = sorted({type(m).__name__ for m in module.modules()})
    return (
        f"{owner} found no normalisation layer in {type(module).__name__} "
        f"({sum(1 for _ in module.modules())} modules of types {', '.join(types)}). "
        "It looks for nn.LayerNorm, nn.RMSNorm and modules with `normalized_shape`, `eps` and "
        "`weight` attributes; declare others with a class attribute "
        "`lnmonitor_norm_kind = 'layer'` (or 'rms') or `lnmonitor.register_norm(cls, kind)`, "
        "or remove the callback."
    )


def say_measured_eps(owner: str, norms: Sequence[NormInfo]) -> None:
    """Say which eps lnmonitor measured for norms that have no eps attribute."""
    measured = [n for n in norms if n.eps_measured]
    if not measured:
        return
    values = sorted({n.eps() for n in measured})
    classes = sorted({type(n.module).__name__ for n in measured})
    rank_zero_info(
        f"{owner}: {', '.join(n.name for n in measured[:4])}{', ...' if len(measured) > 4 else ''} "
        f"({', '.join(classes)}) has no eps attribute; the eps its forward applies, measured "
        f"from its output, is {', '.join(f'{e:g}' for e in values)} (used for sigma, eps/var "
        f"and the transmission). To state it instead: lnmonitor.register_norm({classes[0]}, "
        f"{measured[0].kind!r}, eps=<value>)."
    )


def refused_message(owner: str, refused: Sequence[Refusal]) -> str | None:
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
        f"{owner}: {len(refused)} module(s) look like normalisation layers but are not measured, "
        f"the rest of the model is: {'; '.join(parts)}."
    )

