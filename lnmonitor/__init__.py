"""lnmonitor: Lightning callbacks that watch what LayerNorm does to a transformer while it trains."""

from lnmonitor.errors import HealthWarning  # standard library only

__version__ = "0.1.0"

__all__ = [
    "FinalNormInvarianceMonitor", "HealthWarning", "LayerNormMonitor", "StructureProbe", "register_norm",
]


def _lazy_attributes(package: str, table: dict[str, str]):
    """A module ``__getattr__`` that imports each name of ``table`` from its module on first
    use, so that importing a package (or a light module in it) loads nothing heavy."""

    def __getattr__(name: str):
        if name in table:
            import importlib

            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


# Lazy, so that `import lnmonitor.core.geometry` (layer 1) does not import Lightning.
__getattr__ = _lazy_attributes(__name__, {
    "LayerNormMonitor": "lnmonitor.lightning",
    "FinalNormInvarianceMonitor": "lnmonitor.lightning",
    "StructureProbe": "lnmonitor.lightning",
    "register_norm": "lnmonitor.core.registry",
})
