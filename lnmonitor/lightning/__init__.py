"""The Lightning callbacks, one per module, each logging through its own
:class:`~lnmonitor.lightning.loggers.Loggers`.

* :class:`LayerNormMonitor`: every norm's 1/sigma ladder and dead-plane share;
* :class:`FinalNormInvarianceMonitor`: the final norm's shift and scale invariance;
* :class:`StructureProbe`: block versus branch rank and gain spread after validation.
"""

from lnmonitor.lightning.invariance_monitor import FinalNormInvarianceMonitor
from lnmonitor.lightning.layernorm_monitor import LayerNormMonitor
from lnmonitor.lightning.structure_probe import StructureProbe

__all__ = ["FinalNormInvarianceMonitor", "LayerNormMonitor", "StructureProbe"]
