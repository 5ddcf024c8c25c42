"""The norm kinds (importing nothing, for the command line): ``"layer"`` (LayerNorm-like, centres;
dead subspace span{1, xhat}, k = 2) and ``"rms"`` (RMSNorm-like; dead subspace span{xhat}, k = 1)."""

from typing import Literal

__all__ = ["NORM_KINDS", "NormKind"]

NormKind = Literal["layer", "rms"]

NORM_KINDS = ("layer", "rms")
