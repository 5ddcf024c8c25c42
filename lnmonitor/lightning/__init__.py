"""The Lightning callbacks, one per module, each logging through its own
:class:`~lnmonitor.lightning.loggers.Loggers`: :class:`LayerNormMonitor` (``layernorm_monitor``: every norm's
1/sigma ladder and dead-plane share), :class:`FinalNormInvarianceMonitor` (``invariance_monitor``: the final
norm's shift and scale invariance) and :class:`StructureProbe` (``structure_probe``: block versus branch rank
and gain spread after validation).  Beside them: ``base`` (their messages, guard and checkpoint state),
``loggers`` (scalars, images, layouts, HPARAMS) and ``probe_loss`` (the probe's loss where the module has no
loss contract).
"""

from lnmonitor.lightning.invariance_monitor import FinalNormInvarianceMonitor
from lnmonitor.lightning.layernorm_monitor import LayerNormMonitor
from lnmonitor.lightning.structure_probe import StructureProbe

__all__ = ["FinalNormInvarianceMonitor", "LayerNormMonitor", "StructureProbe"]
