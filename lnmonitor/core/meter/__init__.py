"""One measured step, from the hooks to the figures: ``meter`` (the
:class:`~lnmonitor.core.meter.meter.LadderMeter` every monitor drives, every figure of a step, and
the path one number takes, written at its top), ``taps`` and ``bypass`` (the hooks of one step
and the step's rows), ``row_stats`` (the step vector: each norm's rows binned, merged over
processes and read), ``messages`` (what the meter says, in words), ``padding`` (which rows are
padding), ``growth_watch`` (every step's stream growth), ``processes`` (one number a step, its
maximum over processes) and ``heldout`` (held-out batches through the same meter)."""
