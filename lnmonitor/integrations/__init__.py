"""The integrations of the meter besides Lightning's callbacks (:mod:`lnmonitor.lightning`):

* :class:`lnmonitor.integrations.loop.LoopMonitor`: a plain PyTorch training loop;
* :class:`lnmonitor.integrations.transformers.LNMonitorCallback`: a ``transformers.Trainer``
  (needs the ``hf`` extra; imported only when used).
"""

import importlib

__all__ = ["LNMonitorCallback", "LoopMonitor"]

_MODULES = {"LoopMonitor": "loop", "LNMonitorCallback": "transformers"}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"lnmonitor.integrations.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
