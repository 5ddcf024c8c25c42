"""The monitor every callback drives, framework-free: :mod:`~lnmonitor.core.monitor.monitor`
(:class:`Monitor`: the cadence, what follows a step -- findings, metrics, log, pictures -- the
probe's runs, the end of a run, its state),
:mod:`~lnmonitor.core.monitor.settings` (:class:`Settings`, the one configuration),
:mod:`~lnmonitor.core.monitor.arguments` (the checks of every setting) and
:mod:`~lnmonitor.core.monitor.shared` (how a monitor speaks, the guard around its entry points,
its history)."""
