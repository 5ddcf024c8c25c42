"""lnmonitor.experiments.measure: the held-out tools probe the rows the invariance monitor probes,
at the final norm the meter finds."""

from __future__ import annotations

import torch

from lnmonitor.core.invariance import PROBE_WINDOWS
from lnmonitor.core.probe_rows import first_samples, probe_batch
from lnmonitor.experiments.measure import measure_held_out, probe_rows
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.data import CharDataModule


def test_the_probe_rows_are_the_invariance_monitors_rows_from_the_validation_loader():
    data = CharDataModule(load_corpus(), context=16, batch_size=24)
    # what FinalNormInvarianceMonitor takes from trainer.val_dataloaders (64 windows: three batches)
    monitor = probe_batch(first_samples(data.val_dataloader(), PROBE_WINDOWS), PROBE_WINDOWS)
    ours = probe_rows(data.val_batches())
    assert ours[0].shape[0] == PROBE_WINDOWS
    assert all(torch.equal(a, b) for a, b in zip(ours, monitor, strict=True))


def test_the_invariance_probe_runs_at_the_meters_final_norm(trained):
    m = measure_held_out(trained["module"], trained["batches"], norm_batches=1)
    assert m.invariance.final_norm == m.result.figures.final == "model.lnf"
    assert m.windows == {"loss": 64, "norms": 32, "invariance": 64}
    assert m.order == m.result.figures.rungs  # the tiny GPT: every norm reads the residual stream
