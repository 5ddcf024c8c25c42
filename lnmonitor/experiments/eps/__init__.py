"""The eps comparison (is eps = 1e-1 worse than 1e-5, and why; docs/eps.md): ``grid`` (eps x
seeds over one recipe), ``run`` (one run: train, measure, record), ``compare`` (the whole grid:
shards, workers, resuming), ``store`` (its files), ``statistics`` (intervals across seeds),
``report`` and ``report_figures`` (its report) and ``over_training`` (the loss gap per
validation).  The law across comparisons and the cost as steps lost are research/eps's."""
