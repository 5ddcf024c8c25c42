"""The integrations of the meter besides Lightning's callbacks (:mod:`lnmonitor.lightning`):

* :class:`lnmonitor.integrations.loop.LoopMonitor`: a plain PyTorch training loop;
* :class:`lnmonitor.integrations.transformers.LNMonitorCallback`: a ``transformers.Trainer``
  (needs the ``hf`` extra; imported only when used).
"""

__all__ = ["LNMonitorCallback", "LoopMonitor"]


def __getattr__(name: str):
    if name == "LoopMonitor":
        from lnmonitor.integrations.loop import LoopMonitor

        return LoopMonitor
    if name == "LNMonitorCallback":
        from lnmonitor.integrations.transformers import LNMonitorCallback

        return LNMonitorCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
