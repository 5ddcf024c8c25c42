"""Layer 4: the Lightning callbacks, one per module, each owning its metric sink.

* :class:`LayerNormMonitor`: every norm's 1/sigma ladder and dead-plane share;
* :class:`FinalNormInvarianceMonitor`: the final norm's shift and scale invariance;
* :class:`StructureProbe`: block versus branch rank and gain spread after validation.
"""

from lnmonitor.callbacks.invariance_monitor import FinalNormInvarianceMonitor
from lnmonitor.callbacks.layernorm_monitor import LayerNormMonitor
from lnmonitor.callbacks.structure_probe import StructureProbe

__all__ = ["FinalNormInvarianceMonitor", "LayerNormMonitor", "StructureProbe"]
