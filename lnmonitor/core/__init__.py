"""The measurement, with no Lightning and no framework, in parts by job: ``maths`` (rows to
numbers, the random baseline, histograms), ``norms`` (which norms a model has, their kinds and
roles, the final norm), ``meter`` (one measured step from the hooks to the figures: the
:class:`~lnmonitor.core.meter.meter.LadderMeter` every monitor drives), ``invariance`` (the
final-norm invariance probe), ``findings`` (what the numbers mean for the run), ``probes`` (the
structural probes), ``output`` (the logged names, writers, files) and ``monitor`` (what every
monitor shares below the measurement: the guard, the argument checks); ``kinds``, ``hooks``,
``torch_internals``, ``dtensors`` (tensor-parallel activations) and ``zero3`` (DeepSpeed ZeRO-3's
partitioned parameters) are what every part uses;
``settings`` (the ladder's settings every monitor shares, one name each) and ``after_step`` (the
post-step sequence every monitor runs: metrics, findings, logging, pictures, summary) stand on top
of them all.  Importing this package imports nothing."""
