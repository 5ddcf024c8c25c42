"""How a norm's name is shortened for display, one rule for every table, text and picture (logged tags
keep the whole name)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["ELLIPSIS", "NAME_WIDTH", "name_prefix", "short_name", "short_names"]

NAME_WIDTH = 34  # the summary's norm column, in characters
ELLIPSIS = "..."


def name_prefix(names: Sequence[str]) -> str:
    """The dotted prefix every name shares (``model.model.`` for a Llama held as ``self.model``),
    never a whole name: a lone name keeps its last part."""
    parts = [name.split(".") for name in names]
    if not parts:
        return ""
    common = 0
    while common < min(len(p) for p in parts) - 1 and len({p[common] for p in parts}) == 1:
        common += 1
    return "".join(f"{part}." for part in parts[0][:common])


def short_names(names: Sequence[str], width: int = NAME_WIDTH) -> list[str]:
    """``names`` without their shared :func:`name_prefix`, each at most ``width`` characters: a longer
    one keeps its start and its end, with ``...`` where the middle was cut."""
    cut = len(name_prefix(names))
    out = []
    for name in (name[cut:] for name in names):
        if len(name) > width:
            head = (width - len(ELLIPSIS)) // 2
            name = name[:head] + ELLIPSIS + name[len(name) - (width - len(ELLIPSIS) - head):]
        out.append(name)
    return out


def short_name(name: str, among: Iterable[str], width: int = NAME_WIDTH) -> str:
    """``name`` as :func:`short_names` shows it beside the names ``among`` (``name`` among them or not)."""
    return short_names([name, *among], width)[0]
