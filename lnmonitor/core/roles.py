"""Which norms read the residual stream: the rungs of the 1/sigma ladder, the final norm,
the norms of a branch (a query/key norm, a sublayer's output norm) and the norm of the
embeddings."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

from lnmonitor.core.norms import NormInfo, glob_patterns

__all__ = ["EMBEDDING", "FINAL", "POST", "QK", "RESIDUAL", "RUNGS", "RUNG_BYPASS_TOLERANCE", "assign_roles"]


RESIDUAL, FINAL, QK, POST, EMBEDDING = "residual", "final", "qk", "post", "embedding"
RUNGS = (RESIDUAL, FINAL)  # the roles that read the residual stream: the ladder's rungs
# share of the gradient at a norm's input that goes around it above which the norm's input
# flows on past it (a residual-stream norm); a branch or final norm gives float rounding
RUNG_BYPASS_TOLERANCE = 1e-3
_QK_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm",
             "query_layernorm", "key_layernorm", "norm_q", "norm_k", "q_ln", "k_ln")


def assign_roles(
    norms: Sequence[NormInfo], bypass: dict[str, float] | None = None,
    ladder: str | Sequence[str] | None = None, final_norm: str | None = None,
    tolerance: dict[str, float] | None = None,
) -> list[NormInfo]:
    """``norms`` (in forward order) with their roles.

    With ``ladder`` (glob patterns) the matching norms are the rungs; otherwise a norm is a
    rung when more than ``tolerance[name]`` (default :data:`RUNG_BYPASS_TOLERANCE`) of the
    loss gradient at its input goes around it (``bypass[name]``, measured on a training
    step: its input flows on through the residual), or when that was not measured.  The
    final norm is ``final_norm``, else the last norm to run if its gradient does not go
    around it (with ``ladder``: the last rung); a model without one has none.  It is the
    ladder's last rung.  The other norms are, by name, ``"qk"`` (``q_norm``, ``k_norm``,
    ...) or ``"embedding"`` (``emb`` in its name or its parent's: BERT's ``embeddings.LayerNorm``,
    BLOOM's ``word_embeddings_layernorm``, the stream's start, not a rung), else ``"post"``
    (a sublayer's output before it is added, OLMo2; or, post-LN as in BERT, the sum after it
    is added: no gradient goes around either, and a post-LN model has no pre-norm ladder).
    """
    bypass = bypass or {}
    patterns = glob_patterns(ladder)
    tolerance = tolerance or {}

    def goes_around(name: str) -> bool:  # unmeasured (nan): yes
        return not bypass.get(name, math.nan) <= tolerance.get(name, RUNG_BYPASS_TOLERANCE)

    if patterns is not None:
        rungs = [n.name for n in norms if any(fnmatch.fnmatchcase(n.name, p) for p in patterns)]
        if final_norm is None and rungs:
            final_norm = rungs[-1]
    else:
        rungs = [n.name for n in norms if goes_around(n.name)]
        if final_norm is None and norms and not goes_around(norms[-1].name):
            final_norm = norms[-1].name  # the last norm to run, its input read by it alone

    def role(info: NormInfo) -> str:
        if info.name == final_norm:
            return FINAL
        if info.name in rungs:
            return RESIDUAL
        parts = info.name.lower().split(".")
        if parts[-1] in _QK_NAMES:
            return QK
        return EMBEDDING if any("emb" in part for part in parts[-2:]) else POST  # the norm or its parent

    return [info.with_role(role(info)) for info in norms]
