"""Each norm's role (a rung of the 1/sigma ladder, the final norm, a query/key norm, a branch's output
norm, the embeddings' norm) and its residual stream (stack: an encoder-decoder has two)."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

from lnmonitor.core.monitor.arguments import patterns as glob_patterns
from lnmonitor.core.norms.find import NormInfo

__all__ = [
    "EMBEDDING", "FINAL", "POST", "QK", "RESIDUAL", "RUNGS", "RUNG_BYPASS_TOLERANCE", "STACK_NAMES",
    "assign_roles", "expected_final", "stack_of",
]


RESIDUAL, FINAL, QK, POST, EMBEDDING = "residual", "final", "qk", "post", "embedding"
RUNGS = (RESIDUAL, FINAL)  # the roles that read the residual stream: the ladder's rungs
# share of the gradient at a norm's input going around it above which the norm is a rung
RUNG_BYPASS_TOLERANCE = 1e-3
_QK_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm",
             "query_layernorm", "key_layernorm", "norm_q", "norm_k", "q_ln", "k_ln")
# a module path component that starts a stack of blocks with its own residual stream
STACK_NAMES = ("encoder", "decoder")


def _stack_path(name: str) -> str | None:
    parts = name.split(".")
    i = next((i for i, part in enumerate(parts) if part.lower() in STACK_NAMES), None)
    return None if i is None else ".".join(parts[:i + 1])


def _shared(a: str, b: str) -> int:
    """How many leading path components ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        n += 1
    return n


def stack_of(names: Sequence[str]) -> dict[str, str]:
    """``{norm: stack}`` for ``names`` in forward order.

    A stack is the name up to a norm's first ``encoder``/``decoder`` component; with fewer than two
    stacks every norm is in ``""``.  A norm outside every stack belongs to the one sharing most of its
    path, on a tie to that of the nearest norm that ran before it (or, first to run, after it).
    """
    named = {n: _stack_path(n) for n in names}
    found = list(dict.fromkeys(s for s in named.values() if s is not None))
    if len(found) < 2:
        return dict.fromkeys(names, "")
    out: dict[str, str] = {}
    for i, name in enumerate(names):
        if named[name] is not None:
            out[name] = named[name]
            continue
        best = max(_shared(name, s) for s in found)
        closest = [s for s in found if _shared(name, s) == best]
        nearby = [named[n] for n in [*reversed(names[:i]), *names[i + 1:]] if named[n] in closest]
        out[name] = nearby[0] if nearby else closest[0]
    return out


def assign_roles(norms: Sequence[NormInfo], bypass: dict[str, float] | None = None,
                 ladder: str | Sequence[str] | None = None, final_norm: str | None = None,
                 tolerance: dict[str, float] | None = None) -> list[NormInfo]:
    """``norms`` (in forward order) with their roles.

    The rungs (``"residual"``) are the norms the ``ladder`` globs name, else those around which more
    than ``tolerance[name]`` (default :data:`RUNG_BYPASS_TOLERANCE`) of the gradient at their input
    goes (``bypass[name]``), or where that was not measured unless named for the embeddings.  Each
    stack's ``"final"`` norm is ``final_norm``, else its last norm if no gradient goes around it (with
    ``ladder``: its last rung).  The others are, by name, ``"qk"``, ``"embedding"`` (``emb`` in its
    name or its parent's) or ``"post"`` (a branch's output norm, or post-LN).
    """
    bypass = bypass or {}
    patterns = glob_patterns(ladder, "ladder")
    tolerance = tolerance or {}

    def goes_around(name: str) -> bool:  # unmeasured (nan): yes
        return not bypass.get(name, math.nan) <= tolerance.get(name, RUNG_BYPASS_TOLERANCE)

    def by_name(name: str) -> str:
        parts = name.lower().split(".")
        if parts[-1] in _QK_NAMES:
            return QK
        return EMBEDDING if any("emb" in part for part in parts[-2:]) else POST  # the norm or its parent

    if patterns is not None:
        rungs = [n.name for n in norms if any(fnmatch.fnmatchcase(n.name, p) for p in patterns)]
    else:  # an embedding norm no gradient reached (frozen embeddings) is none
        rungs = [n.name for n in norms if goes_around(n.name)
                 and not (math.isnan(bypass.get(n.name, math.nan)) and by_name(n.name) == EMBEDDING)]
    stack_of_norm = stack_of([n.name for n in norms])
    finals = set()
    for s in dict.fromkeys(stack_of_norm.values()):
        names = [n.name for n in norms if stack_of_norm[n.name] == s]
        if final_norm in names:
            finals.add(final_norm)
        elif patterns is not None:
            finals.update([n for n in names if n in rungs][-1:])
        elif not goes_around(names[-1]):
            finals.add(names[-1])  # the stack's last norm to run, its input read by it alone
    return [info.with_role(FINAL if info.name in finals else RESIDUAL if info.name in rungs
                           else by_name(info.name)) for info in norms]


def expected_final(norms: Sequence[NormInfo], ladder: str | Sequence[str] | None = None,
                   final_norm: str | None = None) -> str | None:
    """The final norm expected before any gradient is measured: ``final_norm``, else the last rung
    :func:`assign_roles` finds with no gradient (None: no rung).  A measured step may find otherwise."""
    if final_norm is not None:
        return final_norm
    rungs = [n.name for n in assign_roles(norms, None, ladder) if n.role in RUNGS]
    return rungs[-1] if rungs else None
