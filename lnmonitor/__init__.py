"""lnmonitor: watch what LayerNorm and RMSNorm do to a transformer while it trains.

Three integrations with the same measurements, each imported on first use (``import lnmonitor``
loads neither Lightning nor transformers): PyTorch Lightning callbacks (:class:`LayerNormMonitor`,
:class:`FinalNormInvarianceMonitor`, :class:`StructureProbe`), a plain PyTorch loop
(:class:`LoopMonitor`) and a ``transformers.Trainer`` (:class:`LNMonitorCallback`, the ``hf`` extra);
each configured by one :class:`Settings` (or keyword arguments of the same names)."""

from lnmonitor.errors import HealthWarning  # standard library only

__version__ = "0.1.0"

__all__ = [
    "FinalNormInvarianceMonitor", "HealthWarning", "LNMonitorCallback", "LayerNormMonitor", "LoopMonitor",
    "Settings", "StructureProbe", "register_norm",
]


def _lazy_attributes(package: str, table: dict[str, str]):
    """A module ``__getattr__`` importing each name of ``table`` from its module on first use."""

    def __getattr__(name: str):
        if name in table:
            import importlib

            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = _lazy_attributes(__name__, {
    "LayerNormMonitor": "lnmonitor.lightning",
    "FinalNormInvarianceMonitor": "lnmonitor.lightning",
    "StructureProbe": "lnmonitor.lightning",
    "register_norm": "lnmonitor.core.norms.registry",
    "Settings": "lnmonitor.core.monitor.settings",
    "LoopMonitor": "lnmonitor.integrations.loop",
    "LNMonitorCallback": "lnmonitor.integrations.transformers",
})
