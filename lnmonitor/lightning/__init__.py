"""The Lightning callbacks, one per module, each logging through its own
:class:`~lnmonitor.lightning.loggers.Loggers`.

* :class:`LayerNormMonitor`: every norm's 1/sigma ladder and dead-plane share;
* :class:`FinalNormInvarianceMonitor`: the final norm's shift and scale invariance;
* :class:`StructureProbe`: block versus branch rank and gain spread after validation.

Each in its own module (``layernorm_monitor``, ``invariance_monitor``, ``structure_probe``),
beside what they share: ``base`` (their messages, guard and checkpoint state), ``loggers`` (the
Trainer's loggers: scalars, images, layouts, HPARAMS) and ``probe_loss`` (the invariance probe's
loss where the module has no loss contract).
"""

from lnmonitor.lightning.invariance_monitor import FinalNormInvarianceMonitor
from lnmonitor.lightning.layernorm_monitor import LayerNormMonitor
from lnmonitor.lightning.structure_probe import StructureProbe

__all__ = ["FinalNormInvarianceMonitor", "LayerNormMonitor", "StructureProbe"]
