"""The measurement, with no framework, by job: ``maths`` (rows to numbers, the random baseline,
histograms), ``norms`` (a model's norms, their kinds and roles), ``meter`` (one measured step:
:class:`~lnmonitor.core.meter.meter.LadderMeter`), ``invariance`` (the final-norm invariance probe),
``findings`` (what the numbers mean), ``probes`` (the structural probes), ``output`` (logged names,
writers, files) and ``monitor`` (the monitor every callback drives, its settings, its guard); and the
modules every part uses: ``kinds`` (the norm kinds), ``hooks`` (temporary hooks, eval mode, eager
code), ``wrappers`` (the model inside Fabric, DDP, ``torch.compile``, FSDP, DeepSpeed), ``float64`` (a
module's float64 forward), ``torch_internals`` (private torch APIs with fallbacks), ``dtensors``
(tensor-parallel rows) and ``zero3`` (ZeRO-3's partitioned parameters).  Imports nothing."""
