"""The two Lightning callbacks on real Trainers: values read back from the TensorBoard
event file against an independent float64 recomputation, cadence, resume, loggers,
TensorBoard extras and bad input."""

from __future__ import annotations

import copy
import csv
import math
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from reference import qr_share
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor, geometry
from lnmonitor.summaries import SHARE_RESOLUTION, SIGMA_RESOLUTION, VAR_RESOLUTION
from lnmonitor.tiny import CharDataModule, TinyGPTModule, load_corpus

WIDTH, CONTEXT, BATCH = 32, 16, 4
TEXT = None



def text() -> str:
    global TEXT
    if TEXT is None:
        TEXT = load_corpus()[:40_000]
    return TEXT


def tiny(steps: int, seed: int = 0, **kw):
    L.seed_everything(seed, verbose=False)
    data = CharDataModule(text(), context=CONTEXT, batch_size=BATCH, max_steps=steps, val_windows=8)
    module = TinyGPTModule(
        data.vocab.chars, width=WIDTH, depth=2, heads=2, context=CONTEXT, max_steps=steps, **kw
    )
    return data, module


def make_trainer(steps, callbacks, logger=False, **kw):
    args = dict(
        accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        logger=logger, callbacks=callbacks, limit_val_batches=1, val_check_interval=steps,
        check_val_every_n_epoch=None,
    )
    args.update(kw)
    return L.Trainer(**args)


def events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def scalars(acc) -> dict[str, dict[int, float]]:
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


class Capture(Callback):
    """Weights and batch at the start of the given optimizer steps (before the update)."""

    def __init__(self, steps):
        self.steps, self.seen = set(steps), {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps and trainer.global_step not in self.seen:
            self.seen[trainer.global_step] = (
                copy.deepcopy(pl_module.state_dict()), [t.clone() for t in batch]
            )


class HookSpy(Callback):
    """Counts forward hooks on the norms at every batch start (after the monitor's)."""

    def __init__(self):
        self.hooks = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        count = sum(
            len(m._forward_hooks) for m in pl_module.modules() if isinstance(m, nn.LayerNorm)
        )
        self.hooks.setdefault(trainer.global_step, count)



def reference(module: TinyGPTModule, state, batch):
    """Independent float64 recomputation: per norm, the share of gain * dL/dy by QR,
    the biased variance and mean square of the input rows."""
    ref = copy.deepcopy(module).double()
    ref.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
    found = {}
    for name, m in ref.named_modules():
        if isinstance(m, nn.LayerNorm):
            def hook(mod, a, o, name=name):
                found[name] = [a[0].detach()]
                o.register_hook(lambda g, name=name: found[name].append(g.detach()))
            m.register_forward_hook(hook)
    _, loss = ref(*batch)
    loss.backward()
    out = {}
    for name, (x, g) in found.items():
        m = ref.get_submodule(name)
        x = x.reshape(-1, x.shape[-1]).numpy()
        w = (g.reshape(-1, x.shape[-1]) * m.weight.detach()).numpy()
        out[name] = dict(share=qr_share(x, w), var=x.var(1), ms=(x**2).mean(1), eps=m.eps)
    return out


# ---------------------------------------------------------------------------
# LayerNormMonitor
# ---------------------------------------------------------------------------


def test_values_in_tensorboard_match_float64(tmp_path):
    steps = 5
    data, module = tiny(steps)
    monitor = LayerNormMonitor(every_n_steps=2)
    capture = Capture([0, 2, 4])
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = make_trainer(steps, [monitor, capture], logger=[tb, csv_logger])
    trainer.fit(module, datamodule=data)

    logged = scalars(events(tb.log_dir))
    names = [f"model.blocks.{i}.ln{j}" for i in range(2) for j in (1, 2)] + ["model.lnf"]
    assert monitor.order == names
    for step in (0, 2, 4):
        ref = reference(module, *capture.seen[step])
        for name in names:
            r = ref[name]
            got = {q: logged[f"lnmonitor/{q}/{name}"][step] for q in (
                "sigma", "inv_sigma", "rms", "eps_over_var", "transmission",
                "share_median", "share_p90", "share_max", "skipped_rows")}
            assert got["share_max"] == pytest.approx(r["share"].max(), abs=1e-4)
            assert abs(got["share_median"] - np.median(r["share"])) <= SHARE_RESOLUTION + 1e-5
            assert abs(got["share_p90"] - np.quantile(r["share"], 0.9)) <= SHARE_RESOLUTION + 1e-5
            v = np.median(r["var"])
            sigma = math.sqrt(v + r["eps"])
            assert got["sigma"] == pytest.approx(sigma, rel=SIGMA_RESOLUTION + 1e-5)
            assert got["inv_sigma"] == pytest.approx(1 / sigma, rel=SIGMA_RESOLUTION + 1e-5)
            assert got["eps_over_var"] == pytest.approx(r["eps"] / v, rel=VAR_RESOLUTION + 1e-5)
            assert got["transmission"] == pytest.approx(r["eps"] / (v + r["eps"]),
                                                        rel=VAR_RESOLUTION + 1e-5)
            assert got["rms"] == pytest.approx(math.sqrt(np.median(r["ms"])),
                                               rel=SIGMA_RESOLUTION + 1e-5)
            assert got["skipped_rows"] == 0
        n_rows = BATCH * CONTEXT
        assert logged["lnmonitor/share_baseline/median"][step] == pytest.approx(
            geometry.share_median(WIDTH, 2), rel=1e-6)
        assert logged["lnmonitor/share_baseline/max"][step] == pytest.approx(
            geometry.max_share_median(WIDTH, 2, n_rows), rel=1e-6)
        first, last = names[0], names[-1]
        assert logged["lnmonitor/ladder/attenuation"][step] == pytest.approx(
            logged[f"lnmonitor/inv_sigma/{first}"][step] / logged[f"lnmonitor/inv_sigma/{last}"][step],
            rel=1e-5)
        assert logged["lnmonitor/ladder/growth"][step] == pytest.approx(
            logged[f"lnmonitor/rms/{last}"][step] / logged[f"lnmonitor/rms/{first}"][step], rel=1e-5)
    assert sorted(logged["lnmonitor/share_max/model.lnf"]) == [0, 2, 4]

    # the CSV logger got the same numbers
    rows = list(csv.DictReader(open(Path(csv_logger.log_dir) / "metrics.csv")))
    csv_vals = {int(r["step"]): float(r["lnmonitor/share_max/model.lnf"])
                for r in rows if r.get("lnmonitor/share_max/model.lnf")}
    assert csv_vals == pytest.approx(logged["lnmonitor/share_max/model.lnf"], rel=1e-6)


def test_cadence_accumulation_and_no_hooks_between(tmp_path):
    steps = 7
    data, module = tiny(steps * 2)
    monitor = LayerNormMonitor(every_n_steps=3, keep_history=True)
    spy = HookSpy()
    trainer = make_trainer(steps, [monitor, spy], accumulate_grad_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    assert [h["step"] for h in monitor.history] == [0, 3, 6]
    assert spy.hooks == {s: (5 if s % 3 == 0 else 0) for s in range(steps)}
    # both micro-batches of the step are measured: 2 * batch * context rows per norm
    assert all(s.rows == 2 * BATCH * CONTEXT for s in monitor.last_summaries)
    assert all(len(m._forward_hooks) == 0 for m in module.modules())


def test_default_cadence_is_log_every_n_steps():
    data, module = tiny(6)
    monitor = LayerNormMonitor(keep_history=True)
    trainer = make_trainer(6, [monitor], log_every_n_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    assert monitor.every_n_steps == 4
    assert [h["step"] for h in monitor.history] == [0, 4]


def test_no_logger_keeps_history_and_warns_once():
    data, module = tiny(4)
    monitor = LayerNormMonitor(every_n_steps=1)
    trainer = make_trainer(4, [monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    ours = [w for w in caught if "has no logger" in str(w.message)]
    assert len(ours) == 1 and "LayerNormMonitor.history" in str(ours[0].message)
    assert [h["step"] for h in monitor.history] == [0, 1, 2, 3]
    assert "lnmonitor/share_median/model.lnf" in monitor.history[0]


def test_tensorboard_layout_hparams_and_histograms(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    data, module = tiny(3)
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [
        LayerNormMonitor(every_n_steps=1, histograms=True),
        FinalNormInvarianceMonitor(every_n_steps=2, on_validation=False),
    ]
    make_trainer(3, callbacks, logger=tb).fit(module, datamodule=data)
    acc = events(tb.log_dir)
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    cats = [c.title for c in layout.category]
    assert cats == [
        "lnmonitor: 1/sigma ladder", "lnmonitor: dead-plane share", "lnmonitor: final-norm invariance",
    ]
    ladder = charts["1/sigma by norm, in forward order"]
    assert len(ladder) == 5 and ladder[0].endswith("model\\.blocks\\.0\\.ln1")
    assert ladder[-1].endswith("model\\.lnf")
    assert "lnmonitor/share_baseline/median.*" in charts["median share vs random median"]
    assert len(charts["delta-loss by case"]) == 5

    ssi = acc.SummaryMetadata("_hparams_/session_start_info")
    info = plugin_data_pb2.HParamsPluginData.FromString(ssi.plugin_data.content).session_start_info
    assert info.hparams["lnmonitor/eps"].number_value == pytest.approx(1e-5)
    assert info.hparams["lnmonitor/norm_kind"].string_value == "layer"
    assert info.hparams["lnmonitor/final_norm"].string_value == "auto"
    assert info.hparams["width"].number_value == WIDTH  # the module's own hparams survive
    exp = acc.SummaryMetadata("_hparams_/experiment")
    names = [m.name.tag for m in plugin_data_pb2.HParamsPluginData.FromString(
        exp.plugin_data.content).experiment.metric_infos]
    assert "lnmonitor/ladder/attenuation" in names and "lnmonitor/invariance/scale_slope" in names

    hists = acc.Tags()["histograms"]
    assert "lnmonitor/hist/share/model.lnf" in hists and "lnmonitor/hist/sigma/model.lnf" in hists
    h = acc.Histograms("lnmonitor/hist/share/model.lnf")[0].histogram_value
    assert h.num == BATCH * CONTEXT and 0.0 <= h.min <= h.max <= 1.0


def test_resume_continues_the_cadence(tmp_path):
    data, module = tiny(12)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_last=True,
                           save_top_k=0)
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    first = LayerNormMonitor(every_n_steps=3)
    make_trainer(5, [first, ckpt], logger=tb, enable_checkpointing=True).fit(module, datamodule=data)
    assert first.state_dict()["last_logged_step"] == 3

    data, module = tiny(12)
    second = LayerNormMonitor(every_n_steps=3)
    tb2 = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = make_trainer(12, [second, ModelCheckpoint(dirpath=tmp_path / "ckpt2")], logger=tb2,
                           enable_checkpointing=True)
    trainer.fit(module, datamodule=data, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert second.state_dict()["last_logged_step"] == 9
    logged = events(tb2.log_dir).Scalars("lnmonitor/share_max/model.lnf")
    assert [e.step for e in logged] == [0, 3, 6, 9]


# ---------------------------------------------------------------------------
# FinalNormInvarianceMonitor
# ---------------------------------------------------------------------------


class ModeSpy(Callback):
    def __init__(self):
        self.modes = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.modes.append(pl_module.training)


def test_invariance_monitor_in_a_trainer(tmp_path):
    data, module = tiny(6)
    inv = FinalNormInvarianceMonitor(every_n_steps=2, probe_size=4)
    spy = ModeSpy()
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = make_trainer(6, [inv, spy], logger=tb, val_check_interval=3)
    trainer.fit(module, datamodule=data)
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
    assert "lnmonitor/invariance/scale_slope" in logged
    assert all(spy.modes)  # the model went back to train mode
    res = inv.last_result
    assert res.rows == 4 * CONTEXT and res.final_norm == "model.lnf"
    assert res.cases["scale_3"].expected_residual == pytest.approx(
        res.cases["scale_3"].out_residual, rel=1e-9)


def test_invariance_monitor_custom_loss_and_explicit_probe():
    data, module = tiny(2)
    x = torch.randint(0, len(data.vocab), (3, CONTEXT))
    calls = []

    def loss_fn(m, b):
        calls.append(b[0].shape)
        return m(*b)[1]

    inv = FinalNormInvarianceMonitor(every_n_steps=1, on_validation=False, probe_batch=(x, x),
                                     loss_fn=loss_fn, final_norm="model.lnf", cases=["shift_5"],
                                     scales=[1.0, 0.01], keep_history=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(2, [inv]).fit(module, datamodule=data)
    # steps 0 and 1, and the point after the last update (taken at the end of each step)
    assert [h["step"] for h in inv.history] == [0, 1, 2]
    assert set(calls) == {torch.Size([3, CONTEXT])}
    assert inv.history[0]["lnmonitor/invariance/shift_5/dloss"] == 0.0
    assert "lnmonitor/invariance/shift_5/max_dlogit" not in inv.history[0]


# ---------------------------------------------------------------------------
# bad input and skipped rows
# ---------------------------------------------------------------------------


class RowsModule(L.LightningModule):
    """Rows of width d through one norm; some rows NaN (masked after the norm), some with a
    zero gradient."""

    def __init__(self, d=8, norm=None, nan_rows=(), dead_rows=()):
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(d, elementwise_affine=False)
        self.lin = nn.Linear(d, 1)
        self.nan_rows, self.dead_rows = list(nan_rows), list(dead_rows)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        x = x.clone()
        x[:, self.nan_rows] = float("nan")
        x.requires_grad_(True)
        y = self.norm(x)
        keep = torch.ones(x.shape[1], 1)
        keep[self.nan_rows + self.dead_rows] = 0.0
        y = torch.where(keep > 0, y, 0.0)
        return self.lin(y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 6, self.norm_width())), batch_size=4)

    def norm_width(self):
        return getattr(self.norm, "normalized_shape", (8,))[0]


def test_skipped_rows_are_counted_and_training_goes_on():
    module = RowsModule(nan_rows=[1], dead_rows=[4])
    monitor = LayerNormMonitor(every_n_steps=1, keep_history=True)
    trainer = make_trainer(3, [monitor], limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    assert trainer.global_step == 3 and all(torch.isfinite(p).all() for p in module.parameters())
    for h in monitor.history:
        assert h["lnmonitor/skipped_rows/norm"] == 2 * 4  # two of six rows, batch of 4
        assert 0.0 <= h["lnmonitor/share_median/norm"] <= 1.0
    assert monitor.last_summaries[0].measured_rows == 5 * 4  # only the NaN row has no sigma


def test_no_norm_or_empty_selection_fails_at_setup():
    class NoNorm(RowsModule):
        def __init__(self):
            super().__init__(norm=nn.Identity())

        def norm_width(self):
            return 8

    with pytest.raises(MisconfigurationException, match="found no normalisation layer.*Linear"):
        make_trainer(1, [LayerNormMonitor()]).fit(NoNorm())
    with pytest.raises(MisconfigurationException, match="found no normalisation layer"):
        make_trainer(1, [FinalNormInvarianceMonitor()]).fit(NoNorm())
    with pytest.raises(MisconfigurationException, match=r"select none.*: norm\. Fix"):
        make_trainer(1, [LayerNormMonitor(include="*.ln1")]).fit(RowsModule())
    data, module = tiny(1)
    with pytest.raises(MisconfigurationException, match="excluded by include/exclude"):
        monitor = LayerNormMonitor(exclude="*lnf", final_norm="model.lnf")
        make_trainer(1, [monitor]).fit(module, datamodule=data)
    with pytest.raises(MisconfigurationException, match="is not a norm"):
        make_trainer(1, [LayerNormMonitor(final_norm="model.head")]).fit(module, datamodule=data)
    with pytest.raises(MisconfigurationException, match="not a normalisation layer.*model.lnf"):
        monitor = FinalNormInvarianceMonitor(final_norm="model.head")
        make_trainer(1, [monitor]).fit(module, datamodule=data)


def test_width_two_is_a_clear_error():
    module = RowsModule(d=2, norm=nn.LayerNorm(2))
    with pytest.raises(MisconfigurationException, match="'norm' has width 2.*exclude=\\['norm'\\]"):
        make_trainer(1, [LayerNormMonitor()]).fit(module)
    rms = RowsModule(d=2, norm=nn.RMSNorm(2))  # k = 1 < 2: fine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(1, [LayerNormMonitor(every_n_steps=1)], limit_val_batches=0).fit(rms)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every_n_steps=0), dict(every_n_steps=-2), dict(every_n_steps=True),
        dict(every_n_steps=2.5), dict(include=[]), dict(exclude=[""]), dict(final_norm=""),
        dict(histograms="yes"), dict(keep_history=1),
    ],
)
def test_layernorm_monitor_bad_arguments(kwargs):
    with pytest.raises(MisconfigurationException):
        LayerNormMonitor(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every_n_steps=0), dict(every_n_steps=None, on_validation=False),
        dict(cases=[]), dict(cases=["shift_7"]), dict(cases=["axis_5", "axis_5"]),
        dict(scales=[0.0]), dict(scales=[float("inf")]), dict(scales="abc"),
        dict(probe_size=0), dict(loss_fn=3), dict(on_validation=None),
    ],
)
def test_invariance_monitor_bad_arguments(kwargs):
    with pytest.raises(MisconfigurationException):
        FinalNormInvarianceMonitor(**kwargs)


def test_bf16_autocast_and_fallback_probe_batch():
    """bf16-mixed training: statistics still in float32 and finite; a module without
    validation data is probed on its first training batch, with a warning."""
    module = RowsModule(d=16, norm=nn.LayerNorm(16))
    ln = LayerNormMonitor(every_n_steps=1, keep_history=True)
    inv = FinalNormInvarianceMonitor(every_n_steps=1, on_validation=False, keep_history=True,
                                     loss_fn=lambda m, b: m.training_step(b, 0), scales=())
    trainer = make_trainer(2, [ln, inv], precision="bf16-mixed", limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert any("probes the first training batch" in str(w.message) for w in caught)
    assert [h["step"] for h in ln.history] == [0, 1]
    assert all(math.isfinite(v) for h in ln.history for v in h.values())
    assert 0 < ln.history[-1]["lnmonitor/share_median/norm"] < 1
    assert inv.history[0]["lnmonitor/invariance/shift_5/dloss"] == 0.0
    assert abs(inv.history[0]["lnmonitor/invariance/axis_5/dloss"]) > 0
