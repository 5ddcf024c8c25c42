"""lnmonitor: Lightning callbacks that watch what LayerNorm does to a transformer while it trains."""

__version__ = "0.1.0"
