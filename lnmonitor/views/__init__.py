"""What people look at: the ladder pictures (``pictures``), the one-screen summary of a run
(``summary``), ``lnmonitor summarize``'s event-file readers and figures (``events``,
``summary_figures``) and the TensorBoard HPARAMS session (``hparams_session``)."""
