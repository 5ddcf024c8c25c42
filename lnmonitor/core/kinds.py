"""The kinds of normalisation layer lnmonitor knows, in a module that imports nothing,
so the command line can name them without importing torch.

* ``"layer"``: LayerNorm-like, subtracts the mean; dead subspace span{1, xhat} (k = 2);
* ``"rms"``: RMSNorm-like, does not centre; dead subspace span{xhat} (k = 1).
"""

from typing import Literal

__all__ = ["NORM_KINDS", "NormKind"]

NormKind = Literal["layer", "rms"]

NORM_KINDS = ("layer", "rms")
