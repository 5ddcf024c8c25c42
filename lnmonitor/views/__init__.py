"""What people look at: the ladder pictures (``pictures``), the one-screen summary of a run
(``summary``) and what a run shows beside its metrics (``run_views``: the pictures and summary a
monitor draws), ``lnmonitor summarize``'s event-file readers and figures (``events``,
``summary_figures``), the TensorBoard HPARAMS session (``hparams_session``), the short names of
norms in every text and figure (``names``) and matplotlib figures written
atomically (``plotting``)."""
