"""The monitor every callback drives, framework-free: ``monitor`` (:class:`Monitor`: the cadence,
what follows a step, the probe's runs, the end of a run, its state), ``settings`` (:class:`Settings`,
the one configuration), ``arguments`` (the checks of every setting) and ``shared`` (how a monitor
speaks, the guard around its entry points, its history)."""
