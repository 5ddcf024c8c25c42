"""FinalNormInvarianceMonitor on real Trainers: cadence and validation points, the model's mode,
custom losses and probe batches, a model without a final norm."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CONTEXT,
    NORMS,
    VOCAB,
    WIDTH,
    char_data,
    events,
    fit,
    fsdp1_units,
    gpt,
    loader,
    monitor,
    scalars,
    trainer,
    windows,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from test_layernorm_monitor_conditions import swap_norms
from torch import nn

from lnmonitor import FinalNormInvarianceMonitor
from lnmonitor.core.invariance.final_norm import final_norm_bypass
from lnmonitor.core.invariance.results import PROBE_WINDOWS
from lnmonitor.core.invariance.runs import FSDP1_REFUSED
from lnmonitor.tiny import TinyGPTModule


class ModeSpy(Callback):
    def __init__(self):
        self.modes = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.modes.append(pl_module.training)


def test_invariance_monitor_in_a_trainer(tmp_path):
    data, module = char_data(6)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=2, on_validation=True, probe_size=4)
    spy = ModeSpy()
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    t = trainer(6, [inv, spy], validate_every=6, logger=tb, val_check_interval=3)
    t.fit(module, datamodule=data)
    logged = scalars(events(tb.log_dir))
    # cadence at 0, 2, 4; validation ends at 3 and 6
    assert sorted(logged["lnmonitor/invariance/shift_5/dloss"]) == [0, 2, 3, 4, 6]
    for step in (0, 2, 3, 4, 6):
        for case in ("shift_5", "shift_1000"):
            assert logged[f"lnmonitor/invariance/{case}/dloss"][step] == 0.0
            assert logged[f"lnmonitor/invariance/{case}/max_dlogit"][step] == 0.0
        assert abs(logged["lnmonitor/invariance/axis_5/dloss"][step]) > 1e-4
        assert logged["lnmonitor/invariance/axis_5/out_residual"][step] > 0.1
        assert 0 < logged["lnmonitor/invariance/scale_3/out_residual"][step] < 0.1
    # the sweep's curves: after each validation (3 and 6), not at the cadence's points 0, 2, 4
    assert sorted(logged["lnmonitor/invariance/scale_rounding_points"]) == [3, 6]
    assert all(spy.modes)  # the model went back to train mode
    res = inv.last_result
    assert res.rows == 4 * CONTEXT and res.final_norm == "model.lnf"
    assert res.cases["scale_3"].expected_residual == pytest.approx(
        res.cases["scale_3"].out_residual, rel=1e-9)


def test_invariance_monitor_custom_loss_and_explicit_probe():
    data, module = char_data(2)
    x = torch.randint(0, len(data.vocab), (3, CONTEXT))
    calls = []

    def loss_fn(m, b):
        calls.append(b[0].shape)
        return m(*b)[1]

    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, probe_batch=(x, x),
                                     loss_fn=loss_fn, final_norm="model.lnf", cases=["shift_5"],
                                     scales=[1.0, 0.01], keep_history=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(2, [inv], validate_every=2).fit(module, datamodule=data)
    # steps 0 and 1, and the point after the last update (taken at the end of each step)
    assert [h["step"] for h in inv.history] == [0, 1, 2]
    assert set(calls) == {torch.Size([3, CONTEXT])}
    assert inv.history[0]["lnmonitor/invariance/shift_5/dloss"] == 0.0
    assert "lnmonitor/invariance/shift_5/max_dlogit" not in inv.history[0]


def test_model_without_a_final_norm_is_said_clearly():
    """No norm before the head: the last norm to run is a block's ln2, whose input goes on
    through the residual, so the loss is not invariant to it.  The invariance monitor
    says so (once) and logs nothing; LayerNormMonitor measures the blocks as usual."""
    batch = windows(2, seed=1)
    normal = gpt(2)
    assert final_norm_bypass(normal, batch, "model.lnf") == 0.0  # a true final norm
    rms = swap_norms(gpt(2), lambda d: nn.RMSNorm(d, eps=1e-5))
    assert final_norm_bypass(rms, batch, "model.lnf") == 0.0
    for final in (None, "model.blocks.1.ln2"):
        module = gpt(3)
        module.model.lnf = nn.Identity()
        assert final_norm_bypass(module, batch, "model.blocks.1.ln2") > 0.1
        mon = monitor()
        inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, keep_history=True,
                                         probe_batch=batch, final_norm=final)
        trainer, caught = fit(module, loader(12, 4), [mon, inv], 3)
        assert trainer.global_step == 3
        said = [w for w in caught if "is not a final norm" in w]
        assert len(said) == 1 and "'model.blocks.1.ln2'" in said[0]
        assert ("final_norm='model.blocks.1.ln2'" in said[0]) == (final is not None)
        assert inv.history == [] and inv.last_result is None
        assert "residual" in inv.off_reason
        assert mon.order == NORMS[:-1] and len(mon.history) == 3
        assert "lnmonitor/ladder/attenuation" in mon.history[0]


def test_a_callback_reused_for_a_second_fit_probes_the_second_model():
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, keep_history=True)
    fit(gpt(2), loader(8, 4), [inv], 2)
    first_probe = inv._probe
    fit(gpt(2, seed=1), loader(8, 4, seed=1), [inv], 2)
    assert [h["step"] for h in inv.history] == [0, 1, 2]
    assert not torch.equal(inv._probe[0], first_probe[0])  # this fit's batch, not the last one's


class ValidationOnlyStep(TinyGPTModule):
    """A module with a validation_step but no val_dataloader: its loaders come from fit()."""

    def validation_step(self, batch, batch_idx):
        return None


def test_the_probe_comes_from_the_validation_loader_given_to_fit():
    module = ValidationOnlyStep(VOCAB, width=WIDTH, depth=2, heads=2, context=CONTEXT, max_steps=2)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, probe_size=2)
    val = loader(8, 4, seed=7)
    _, caught = fit(module, loader(8, 4), [inv], 2, val=val, **{"val_check_interval": 2,
                                                              "check_val_every_n_epoch": None})
    assert not any("no validation data" in w for w in caught)
    assert torch.equal(inv._probe[0], next(iter(val))[0][:2])


class LogitsOnly(TinyGPTModule):
    """forward(x) returns logits (a two-argument call raises TypeError); the loss is computed
    in training_step, which also logs it."""

    def forward(self, x):
        return self.model(x)[0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train/loss", loss)
        return loss


def test_a_forward_that_returns_logits_is_probed_through_training_step(tmp_path):
    module = LogitsOnly(VOCAB, width=WIDTH, depth=2, heads=2, context=CONTEXT, max_steps=3)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, probe_batch=windows(2),
                                     keep_history=True)
    t, _ = fit(module, loader(12, 4), [inv], 3, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    assert t.global_step == 3 and inv.off_reason is None
    assert [h["step"] for h in inv.history] == [0, 1, 2, 3]
    h = inv.history[0]
    assert h["lnmonitor/invariance/shift_5/dloss"] == 0.0 and abs(h["lnmonitor/invariance/axis_5/dloss"]) > 0
    assert "lnmonitor/invariance/shift_5/max_dlogit" not in h  # training_step returns no logits
    logged = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    assert len([r for r in logged if r.get("train/loss")]) == 3  # the probes logged nothing


class NoLossAnywhere(LogitsOnly):
    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(x).flatten(0, 1), y.flatten()))
        opt.step()


def test_without_any_loss_the_monitor_says_how_to_pass_one_and_training_goes_on():
    module = NoLossAnywhere(VOCAB, width=WIDTH, depth=2, heads=2, context=CONTEXT, max_steps=3)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, probe_batch=windows(2))
    t, caught = fit(module, loader(12, 4), [inv], 3)
    assert t.global_step == 3 and inv.last_result is None
    said = [w for w in caught if "FinalNormInvarianceMonitor is off" in w]
    assert len(said) == 1 and "loss_fn=lambda module, batch" in said[0]
    assert "forward(*batch): TypeError" in said[0] and "manual optimisation" in said[0]


def test_the_monitor_probes_the_rows_analyze_and_eps_compare_probe():
    """One definition of the probe rows: by default the monitor takes the first PROBE_WINDOWS
    held-out windows, across the validation batches, exactly what the pipeline measures."""
    from lnmonitor.experiments.measure import held_out_probe

    data, module = char_data(2, batch=4)
    data.val_windows = 128
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False)
    trainer(2, [inv], validate_every=2).fit(module, datamodule=data)
    x, y = held_out_probe(data.val_batches())
    assert inv._probe[0].shape[0] == PROBE_WINDOWS == x.shape[0]
    assert torch.equal(inv._probe[0], x) and torch.equal(inv._probe[1], y)


class ProbePasses(Callback):
    """Forward passes of the model outside training (the probe's), per optimizer step; and of
    those, the passes that ran the first block's insides (``whole``: not replayed)."""

    def __init__(self):
        self.passes: dict[int, int] = {}
        self.whole: dict[int, int] = {}

    def setup(self, trainer, pl_module, stage):
        def counter(into):
            def count(module, args):
                if not torch.is_grad_enabled():
                    into[trainer.global_step] = into.get(trainer.global_step, 0) + 1
            return count
        pl_module.model.register_forward_pre_hook(counter(self.passes))
        pl_module.model.blocks[0].attn.register_forward_pre_hook(counter(self.whole))


@pytest.mark.parametrize("sweep_every", [None, 2])
def test_the_sweep_runs_at_the_end_and_the_cadence_runs_the_cases(sweep_every, tmp_path):
    # a periodic run is the base pass and the five cases (6 passes); the 8-scale sweep (7 more,
    # a = 1 reuses the base) runs at the end of the fit, added to the last point, or at its
    # own cadence
    data, module = char_data(4)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=2, sweep_every_n_steps=sweep_every,
                                     probe_size=4, keep_history=True)
    passes = ProbePasses()
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(4, [inv, passes], logger=tb, limit_val_batches=0).fit(module, datamodule=data)
    logged = scalars(events(tb.log_dir))
    assert sorted(logged["lnmonitor/invariance/axis_5/dloss"]) == [0, 2, 4]
    swept = [0, 2, 4] if sweep_every else [4]
    assert sorted(logged["lnmonitor/invariance/scale_rounding_points"]) == swept
    assert [h["step"] for h in inv.history] == [0, 2, 4]
    assert [("lnmonitor/invariance/scale_rounding_points" in h) for h in inv.history] == [
        h["step"] in swept for h in inv.history]
    assert len(inv.last_result.sweep) == 8 and len(inv.last_result.cases) == 5
    # the first point's set-up aside (finding the probe's loss and the final norm: 2 passes), 6
    # passes, 13 with the sweep; the end's sweep alone is the base and 7 scales.  Each run passes
    # once more, to check its replay; and only its first pass runs the blocks, the others replay them
    extra = {0: 2}
    want = {s: 14 + extra.get(s, 0) if sweep_every else 7 + extra.get(s, 0) for s in (0, 2)}
    want[4] = 14 if sweep_every else 7 + 9
    assert {s: passes.passes.get(s, 0) for s in (0, 2, 4)} == want
    assert {s: passes.whole.get(s, 0) for s in (0, 2, 4)} == {0: 3, 2: 1, 4: 1 if sweep_every else 2}


def test_an_fsdp1_model_turns_the_probe_off_saying_why_and_the_ladder_goes_on():
    """FSDP1 units (Lightning's FSDPStrategy wraps each block so) gather their weights only inside
    the wrapper's forward, and the probe's passes call the LightningModule: the probe refuses, once,
    naming what to use instead; the fit and LayerNormMonitor go on.  (Lightning's FSDPStrategy needs
    CUDA: tests/test_cuda.py runs it; here real FSDP1 units on one gloo process.)"""
    module = gpt(2)
    with fsdp1_units(module.model.blocks):
        mon = monitor()
        inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, keep_history=True,
                                         probe_batch=windows(2))
        trainer, caught = fit(module, loader(8, 4), [mon, inv], 2)
    assert trainer.global_step == 2 and len(mon.history) == 2
    assert [s.rows > 0 for s in mon.last_row_stats] == [True] * len(NORMS)  # every norm measured
    assert inv.off_reason == FSDP1_REFUSED and inv.history == []
    assert sum(FSDP1_REFUSED in w for w in caught) == 1
