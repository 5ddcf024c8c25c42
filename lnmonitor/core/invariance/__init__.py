"""The final-norm invariance probe: ``measure`` (the cases, in plain torch), ``results`` (its cases, scales
and result types), ``probe`` (one model's probe with its state), ``runs`` (one rule for the probe's runs at
training steps, in every monitor), ``loss_contract`` (what a forward returns and how a batch is passed),
``replay`` (the part of a forward before the final norm, replayed), ``sweep`` (the scale sweep's fit window),
``probe_rows`` (the held-out rows it runs on) and ``final_norm`` (the meter's final-norm rule on the probe's
own rows, where no meter decided, and its check)."""
