"""lnmonitor.experiments.measure: the held-out tools probe the rows the invariance monitor probes,
at the final norm the meter finds: one checkpoint, one slope."""

from __future__ import annotations

import math

import torch
from conftest import MemoryLogger

from lnmonitor.core.invariance.probe_rows import first_samples, probe_batch
from lnmonitor.core.invariance.results import PROBE_WINDOWS
from lnmonitor.experiments.measure import held_out_measurement, held_out_probe
from lnmonitor.lightning import FinalNormInvarianceMonitor
from lnmonitor.tiny.checkpoint import load_checkpoint
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.data import CharDataModule
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit


def test_the_probe_rows_are_the_invariance_monitors_rows_from_the_validation_loader():
    data = CharDataModule(load_corpus(), context=16, batch_size=24)
    # what FinalNormInvarianceMonitor takes from trainer.val_dataloaders (64 windows: three batches)
    monitor = probe_batch(first_samples(data.val_dataloader(), PROBE_WINDOWS), PROBE_WINDOWS)
    ours = held_out_probe(data.val_batches())
    assert ours[0].shape[0] == PROBE_WINDOWS
    assert all(torch.equal(a, b) for a, b in zip(ours, monitor, strict=True))


def test_the_invariance_probe_runs_at_the_meters_final_norm(trained):
    m = held_out_measurement(trained["module"], trained["batches"], norm_batches=1)
    assert m.invariance.final_norm == m.result.figures.final == "model.lnf"
    assert m.windows == {"loss": 64, "norms": 32, "invariance": 64}
    assert m.order == m.result.figures.rungs  # the tiny GPT: every norm reads the residual stream


def test_one_checkpoint_gives_the_invariance_monitor_and_the_held_out_tools_one_slope(tmp_path):
    """The monitor's end-of-fit probe and ``held_out_measurement`` on the saved checkpoint: the same
    probe rows and final norm, so the same cases and the same scale-sweep fit, to the bit."""
    logger = MemoryLogger()
    recipe = Recipe(width=32, depth=2, heads=2, context=16, max_steps=30, val_every=30)
    text = load_corpus()
    result = fit(recipe, text, tmp_path, callbacks=[FinalNormInvarianceMonitor()], logger=logger,
                 progress=False)
    logged: dict = {}
    for _, metrics in logger.logged:
        logged.update(metrics)
    module = load_checkpoint(result.checkpoint)[0]
    batches = CharDataModule(text, vocab=module.vocab, context=recipe.context).val_batches()
    inv = held_out_measurement(module, batches, norm_batches=1).invariance
    assert math.isfinite(inv.slope)
    assert logged["lnmonitor/invariance/scale_slope"] == inv.slope
    assert logged["lnmonitor/invariance/scale_constant"] == inv.constant
    assert logged["lnmonitor/invariance/axis_5/dloss"] == inv.cases["axis_5"].dloss
