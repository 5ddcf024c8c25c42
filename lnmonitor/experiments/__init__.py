"""Experiments built on the tiny recipe and the meter: ``measure`` (a trained model on held-out
text, behind ``analyze`` and ``eps-compare``), ``analysis``, ``analysis_report`` and
``analysis_figures`` (``lnmonitor analyze``), ``plotting`` (what their figures share), and one
part: ``eps`` (the eps comparison, ``lnmonitor eps-compare``).  The research that chose the
findings (the stability testbed, the eps law and delay) is research/, not installed."""
