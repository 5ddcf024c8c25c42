"""lnmonitor: Lightning callbacks that watch what LayerNorm does to a transformer while it trains."""

__version__ = "0.1.0"

__all__ = ["FinalNormInvarianceMonitor", "LayerNormMonitor", "StructureProbe", "register_norm"]

_LAZY = {
    "LayerNormMonitor": "lnmonitor.callbacks",
    "FinalNormInvarianceMonitor": "lnmonitor.callbacks",
    "register_norm": "lnmonitor.taps",
    "StructureProbe": "lnmonitor.probe_callback",
}


def __getattr__(name: str):
    # Lazy, so that `import lnmonitor.geometry` (layer 1) does not import Lightning.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lnmonitor' has no attribute {name!r}")
