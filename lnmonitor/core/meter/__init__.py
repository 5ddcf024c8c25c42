"""One measured step, from the hooks to the finished numbers: ``meter`` (the
:class:`~lnmonitor.core.meter.meter.LadderMeter` every monitor drives, and the path one number
takes, written at its top), ``taps`` and ``bypass`` (the hooks of one step and the step's rows),
``row_stats`` (each norm's statistics), ``ladder`` (every figure reported about a step's norms),
``messages`` (what the meter says, in words), ``padding`` (which rows are padding),
``growth_watch`` (every step's stream growth), ``processes`` (a step merged over processes at a
fixed cost a rank, and the every-step growth's maximum over them) and ``heldout`` (held-out
batches through the same meter)."""
