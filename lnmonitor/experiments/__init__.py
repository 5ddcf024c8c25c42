"""Experiments built on the tiny recipe and the meter: ``measure`` (a trained model on held-out
text, behind ``analyze`` and ``eps-compare``), ``analysis``, ``analysis_report`` and
``analysis_figures`` (``lnmonitor analyze``), ``plotting`` (what their figures share), and two
parts: ``eps`` (the eps comparison) and ``stability`` (the findings' testbed)."""
