"""The measurement, with no Lightning and no framework, in parts by job: ``maths`` (rows to
numbers, the random baseline, histograms), ``norms`` (which norms a model has, their kinds and
roles, the final norm), ``meter`` (one measured step from the hooks to the figures: the
:class:`~lnmonitor.core.meter.meter.LadderMeter`), ``invariance`` (the final-norm invariance
probe), ``findings`` (what the numbers mean for the run), ``probes`` (the structural probes),
``output`` (the logged names, writers, files) and ``monitor`` (the monitor every callback drives,
its settings, its guard); and the modules every part uses: ``kinds`` (the norm kinds), ``hooks``
(temporary hooks, eval mode, eager code), ``wrappers`` (the model inside Fabric, DDP,
``torch.compile``, FSDP, DeepSpeed), ``float64`` (a module's float64 forward),
``torch_internals`` (private torch APIs with fallbacks), ``dtensors`` (tensor-parallel rows) and
``zero3`` (DeepSpeed ZeRO-3's partitioned parameters).  Importing this package imports nothing."""
