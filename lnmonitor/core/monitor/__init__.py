"""What every monitor (the Lightning callbacks, the Trainer callback, the plain loop's monitor)
shares below the measurement: ``shared`` (how it speaks, the one guard around its entry points,
the one "off for the rest of this run" sentence, its history) and ``arguments`` (the checks of
its constructor arguments).  The post-step sequence that sits on top of the measurement is
:mod:`lnmonitor.core.after_step`."""
