"""Which norms read the residual stream: the rungs of the 1/sigma ladder, the final norm,
the norms of a branch (a query/key norm, a sublayer's output norm) and the norm of the
embeddings; and which residual stream (stack) each norm belongs to: an encoder-decoder has
two, each a ladder with its own final norm."""

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
# share of the gradient at a norm's input that goes around it above which the norm's input
# flows on past it (a residual-stream norm); a branch or final norm gives float rounding
RUNG_BYPASS_TOLERANCE = 1e-3
_QK_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm",
             "query_layernorm", "key_layernorm", "norm_q", "norm_k", "q_ln", "k_ln")
# a module path component that starts a stack of blocks with its own residual stream
STACK_NAMES = ("encoder", "decoder")


def _stack_path(name: str) -> str | None:
    """``name`` up to its first ``encoder``/``decoder`` component, or None."""
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
    """``{norm: stack}``: the stack (residual stream) each norm belongs to, ``names`` in forward order.

    A stack is the qualified name of a module called ``encoder`` or ``decoder`` (the first
    such component of a norm's name: T5's ``encoder``, BART's ``model.decoder``); each has its
    own residual stream.  A model with fewer than two of them has one stream, ``""`` (every
    decoder-only model, OPT's ``model.decoder`` and BERT's ``bert.encoder`` included).  A norm
    outside every stack belongs to the stack whose name shares the most of its path, and on
    a tie to the stack of the norm that ran just before it (or, first to run, just after).
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


def assign_roles(
    norms: Sequence[NormInfo], bypass: dict[str, float] | None = None,
    ladder: str | Sequence[str] | None = None, final_norm: str | None = None,
    tolerance: dict[str, float] | None = None,
) -> list[NormInfo]:
    """``norms`` (in forward order) with their roles.

    With ``ladder`` (glob patterns) the matching norms are the rungs; otherwise a norm is a
    rung when more than ``tolerance[name]`` (default :data:`RUNG_BYPASS_TOLERANCE`) of the
    loss gradient at its input goes around it (``bypass[name]``, measured on a training
    step: its input flows on through the residual), or when that was not measured (no
    gradient reached it: frozen inputs) and its name does not say it is an embedding norm.  Each
    stack (:func:`stack_of`: an encoder-decoder's encoder and decoder, else the whole model)
    has its own final norm: ``final_norm`` in its stack, else the stack's last norm to run if
    its gradient does not go around it (with ``ladder``: the stack's last rung); a stack
    without one has none.  It is its ladder's last rung.  The other norms are, by name,
    ``"qk"`` (``q_norm``, ``k_norm``,
    ...) or ``"embedding"`` (``emb`` in its name or its parent's: BERT's ``embeddings.LayerNorm``,
    BLOOM's ``word_embeddings_layernorm``, the stream's start, not a rung), else ``"post"``
    (a sublayer's output before it is added, OLMo2; or, post-LN as in BERT, the sum after it
    is added: no gradient goes around either, and a post-LN model has no pre-norm ladder).
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

    def rung(name: str) -> bool:  # an embedding norm no gradient reached (frozen embeddings) is none
        unmeasured = math.isnan(bypass.get(name, math.nan))
        return goes_around(name) and not (unmeasured and by_name(name) == EMBEDDING)

    if patterns is not None:
        rungs = [n.name for n in norms if any(fnmatch.fnmatchcase(n.name, p) for p in patterns)]
    else:
        rungs = [n.name for n in norms if rung(n.name)]
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

    def role(info: NormInfo) -> str:
        if info.name in finals:
            return FINAL
        if info.name in rungs:
            return RESIDUAL
        return by_name(info.name)

    return [info.with_role(role(info)) for info in norms]


def expected_final(
    norms: Sequence[NormInfo], ladder: str | Sequence[str] | None = None, final_norm: str | None = None,
) -> str | None:
    """The final norm of the model's ladder before any gradient is measured: :func:`assign_roles`'s
    rule on what is known then.  ``final_norm`` when named; else the last rung with no gradient
    measured (a norm not named for the embeddings, or one the ``ladder`` patterns name) of
    ``norms``, in forward order as far as it is known (a resumed run's order, else module order).
    None when there is no rung.  A measured step may find otherwise: the last norm's input may
    flow on past it (no final norm), or module order may not be the order the forward runs."""
    if final_norm is not None:
        return final_norm
    rungs = [n.name for n in assign_roles(norms, None, ladder) if n.role in RUNGS]
    return rungs[-1] if rungs else None
