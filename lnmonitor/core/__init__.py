"""The measurement, with no Lightning and no framework: the maths (``geometry``,
``random_baseline``, ``reductions``), the norms of a model (``registry``, ``identify``,
``norms``, ``discovery``), touching a model without a trace (``hooks``, ``torch_internals``,
``taps``, ``step_rows``, ``bypass``), a step's histograms, per-norm statistics and figures
(``histograms``, ``row_stats``, ``ladder``), the meter every door drives (``meter``, its words
in ``meter_messages``), the invariance probe (``invariance`` and its ``invariance_results``,
``invariance_probe``, ``final_norm``, ``loss_contract``, ``sweep``), the structural and
held-out probes (``probes``, ``blocks``, ``heldout``, ``probe_rows``), the logged names
(``metric_names``), the doors' argument checks (``arguments``) and scalar writing
(``writers``).  Importing this package imports nothing."""
