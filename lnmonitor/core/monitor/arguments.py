"""Checks of the monitors' constructor arguments: each returns the value in its canonical form or
raises :class:`ArgumentError` naming the argument and what to pass, at construction, not at step 1000."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping

__all__ = [
    "ArgumentError", "child_path", "choices", "flag", "fraction", "function", "module_name",
    "optional_flag", "patterns", "position", "positive_int", "row_mask", "scales",
]


class ArgumentError(ValueError):
    """A constructor argument of the wrong type or range; the message says what to pass."""


def _integer(value) -> int | None:
    """``value`` as an int when it is an integer (numpy's too), not a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return int(operator.index(value))
    except TypeError:
        return None


def positive_int(value, name: str, *, allow_none: bool = True, unit: str = "optimizer steps") -> int | None:
    if value is None and allow_none:
        return None
    number = _integer(value)
    if number is None or number < 1:
        hint = " or None" if allow_none else ""
        raise ArgumentError(f"{name} must be a positive integer ({unit}){hint}, got {value!r}")
    return number


def position(value, name: str, hint: str) -> int:
    number = _integer(value)
    if number is None:
        raise ArgumentError(f"{name} must be an integer sequence position ({hint}), got {value!r}")
    return number


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return value


def optional_flag(value, name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True, False or None, got {value!r}")
    return value


def _strings(value) -> tuple | None:
    """A string as a 1-tuple, a collection (not bytes or a mapping) as a tuple, else None."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, Mapping)):
        return tuple(value)
    return None


def patterns(value, name: str) -> tuple[str, ...] | None:
    """One glob or several as a tuple (None stays None)."""
    if value is None:
        return None
    items = _strings(value)
    if not items or not all(isinstance(p, str) and p for p in items):
        raise ArgumentError(
            f"{name} must be a glob pattern or a list of glob patterns over qualified module "
            f"names (e.g. 'model.blocks.*.ln1'), got {value!r}")
    return items


def module_name(value, name: str, example: str) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise ArgumentError(f"{name} must be the qualified name of a module (e.g. {example!r}) or None, "
                            f"got {value!r}")
    return value


def choices(value, name: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A non-empty list of distinct names from ``allowed`` (a single name is a list of one)."""
    items = _strings(value) or (value,)
    bad = [c for c in items if not isinstance(c, str) or c not in allowed]
    if not items or bad or len(set(items)) != len(items):
        raise ArgumentError(f"{name} must be a non-empty list of distinct names from {list(allowed)}, "
                            f"got {value!r}")
    return items


def scales(value, name: str) -> tuple[float, ...]:
    given, items = None if isinstance(value, str) else _strings(value), None
    if given is not None and all(isinstance(a, numbers.Real) and not isinstance(a, bool) for a in given):
        try:
            items = tuple(float(a) for a in given)
        except (TypeError, ValueError, OverflowError):
            pass
    if items is None or any(not (math.isfinite(a) and a > 0) for a in items) or len(set(items)) != len(items):
        raise ArgumentError(f"{name} must be a list of distinct finite numbers > 0, got {value!r}")
    return items


def fraction(value, name: str, hint: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise ArgumentError(f"{name} must be a float in (0, 1) or None ({hint}), got {value!r}")
    return float(value)


def function(value, name: str, signature: str) -> Callable | None:
    if value is not None and not callable(value):
        raise ArgumentError(f"{name} must be a callable {signature} or None, got {value!r}")
    return value


def row_mask(value) -> Callable | bool | None:
    """``None`` (the batch's own padding mask), ``False`` (every row counts) or a callable."""
    if value is None or value is False or callable(value):
        return value
    raise ArgumentError(
        f"row_mask must be None (padding from the batch's attention_mask), False (no "
        f"mask) or a callable row_mask(batch) -> bool tensor of the rows to measure, got {value!r}")


def child_path(value, name: str) -> tuple[str, ...] | Callable | None:
    """``None``, a callable, or a sequence of child module names such as ``('ln1', 'attn')``."""
    if value is None or callable(value):
        return value
    items = None if isinstance(value, str) else _strings(value)
    if not items or not all(isinstance(n, str) and n for n in items):
        raise ArgumentError(
            f"{name} must be a sequence of child names such as ('ln1', 'attn'), a callable "
            f"(block, h) -> output, or None; got {value!r}")
    return items
