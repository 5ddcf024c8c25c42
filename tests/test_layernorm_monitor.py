"""LayerNormMonitor on real Trainers: values read back from TensorBoard and CSV against an
independent float64 recomputation, cadence, resume, no logger, skipped rows, setup errors."""

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
import torch.nn.functional as F
from conftest import (
    CONTEXT,
    NORMS,
    VOCAB,
    WIDTH,
    assert_close_history,
    char_data,
    events,
    fit,
    float64_reference,
    gpt,
    hparams_columns,
    loader,
    monitor,
    scalars,
    trainer,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lnmonitor
from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.maths import random_baseline
from lnmonitor.core.meter.row_stats import SHARE_RESOLUTION, SIGMA_RESOLUTION, VAR_RESOLUTION
from lnmonitor.tiny import TinyGPTModule


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


def test_values_in_tensorboard_match_float64(tmp_path):
    steps = 5
    data, module = char_data(steps)
    monitor = LayerNormMonitor(every_n_steps=2)
    capture = Capture([0, 2, 4])
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    t = trainer(steps, [monitor, capture], validate_every=steps, logger=[tb, csv_logger])
    t.fit(module, datamodule=data)

    logged = scalars(events(tb.log_dir))
    names = [f"model.blocks.{i}.ln{j}" for i in range(2) for j in (1, 2)] + ["model.lnf"]
    assert monitor.order == names
    for step in (0, 2, 4):
        ref = float64_reference(module, capture.seen[step][1], state=capture.seen[step][0])
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
        n_rows = 4 * CONTEXT
        assert logged["lnmonitor/share_baseline/median"][step] == pytest.approx(
            random_baseline.share_median(WIDTH, 2), rel=1e-6)
        assert logged["lnmonitor/share_baseline/max"][step] == pytest.approx(
            random_baseline.max_share_median(WIDTH, 2, n_rows), rel=1e-6)
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
    data, module = char_data(steps * 2)
    monitor = LayerNormMonitor(every_n_steps=3, keep_history=True)
    spy = HookSpy()
    t = trainer(steps, [monitor, spy], validate_every=steps, accumulate_grad_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(module, datamodule=data)
    assert [h["step"] for h in monitor.history] == [0, 3, 6]
    assert spy.hooks == {s: (5 if s % 3 == 0 else 0) for s in range(steps)}
    # both micro-batches of the step are measured: 2 * batch * context rows per norm
    assert all(s.rows == 2 * 4 * CONTEXT for s in monitor.last_row_stats)
    assert all(len(m._forward_hooks) == 0 for m in module.modules())


def test_default_cadence_is_log_every_n_steps_and_the_last_step_is_always_measured():
    data, module = char_data(6)
    monitor = LayerNormMonitor(keep_history=True)
    t = trainer(6, [monitor], validate_every=6, log_every_n_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(module, datamodule=data)
    assert monitor.every_n_steps == 4
    assert [h["step"] for h in monitor.history] == [0, 4, 5]  # 5: the fit's last step


def test_no_logger_keeps_history_and_warns_once():
    data, module = char_data(4)
    monitor = LayerNormMonitor(every_n_steps=1)
    t = trainer(4, [monitor], validate_every=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module, datamodule=data)
    ours = [w for w in caught if "has no logger" in str(w.message)]
    assert len(ours) == 1 and "LayerNormMonitor.history" in str(ours[0].message)
    assert [h["step"] for h in monitor.history] == [0, 1, 2, 3]
    assert "lnmonitor/share_median/model.lnf" in monitor.history[0]


def test_resume_continues_the_cadence(tmp_path):
    data, module = char_data(12)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_last=True,
                           save_top_k=0)
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    first = LayerNormMonitor(every_n_steps=3)
    t = trainer(5, [first, ckpt], validate_every=5, logger=tb, enable_checkpointing=True)
    t.fit(module, datamodule=data)
    assert first.state_dict()["last_logged_step"] == 4  # 0, 3 and the fit's last step

    data, module = char_data(12)
    second = LayerNormMonitor(every_n_steps=3)
    tb2 = TensorBoardLogger(tmp_path, name="tb", version=0)
    t = trainer(12, [second, ModelCheckpoint(dirpath=tmp_path / "ckpt2")], validate_every=12, logger=tb2,
                           enable_checkpointing=True)
    t.fit(module, datamodule=data, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert second.state_dict()["last_logged_step"] == 11
    logged = events(tb2.log_dir).Scalars("lnmonitor/share_max/model.lnf")
    assert [e.step for e in logged] == [0, 3, 4, 6, 9, 11]  # each fit ends measured


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
    t = trainer(3, [monitor], validate_every=3, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(module)
    assert t.global_step == 3 and all(torch.isfinite(p).all() for p in module.parameters())
    for h in monitor.history:
        assert h["lnmonitor/skipped_rows/norm"] == 4  # the NaN row (one of six, batch of 4)
        assert h["lnmonitor/zero_grad_rows/norm"] == 4  # the row the loss does not read
        assert 0.0 <= h["lnmonitor/share_median/norm"] <= 1.0
        assert math.isfinite(h["lnmonitor/sigma/norm"])  # the NaN row has no sigma and spoils none


def test_no_norm_or_empty_selection_fails_at_setup():
    class NoNorm(RowsModule):
        def __init__(self):
            super().__init__(norm=nn.Identity())

        def norm_width(self):
            return 8

    with pytest.raises(MisconfigurationException, match="found no normalisation layer.*Linear"):
        trainer(1, [LayerNormMonitor()], validate_every=1).fit(NoNorm())
    with pytest.raises(MisconfigurationException, match="found no normalisation layer"):
        trainer(1, [FinalNormInvarianceMonitor()], validate_every=1).fit(NoNorm())
    with pytest.raises(MisconfigurationException, match=r"select none.*: norm\. Fix"):
        trainer(1, [LayerNormMonitor(include="*.ln1")], validate_every=1).fit(RowsModule())
    data, module = char_data(1)
    with pytest.raises(MisconfigurationException, match="excluded by include/exclude"):
        monitor = LayerNormMonitor(exclude="*lnf", final_norm="model.lnf")
        trainer(1, [monitor], validate_every=1).fit(module, datamodule=data)
    with pytest.raises(MisconfigurationException, match="is not a norm"):
        trainer(1, [LayerNormMonitor(final_norm="model.head")], validate_every=1).fit(module, datamodule=data)
    # both monitors share one discovery prologue, and so its message
    with pytest.raises(MisconfigurationException, match="is not a norm.*model.lnf"):
        monitor = FinalNormInvarianceMonitor(final_norm="model.head")
        trainer(1, [monitor], validate_every=1).fit(module, datamodule=data)


def test_width_two_is_a_clear_error():
    module = RowsModule(d=2, norm=nn.LayerNorm(2))
    with pytest.raises(MisconfigurationException, match="'norm' has width 2.*exclude=\\['norm'\\]"):
        trainer(1, [LayerNormMonitor()], validate_every=1).fit(module)
    rms = RowsModule(d=2, norm=nn.RMSNorm(2))  # k = 1 < 2: fine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(1, [LayerNormMonitor(every_n_steps=1)], validate_every=1, limit_val_batches=0).fit(rms)


def test_bf16_autocast_and_fallback_probe_batch():
    """bf16-mixed training: statistics still in float32 and finite; a module without
    validation data is probed on its first training batch, with a warning."""
    module = RowsModule(d=16, norm=nn.LayerNorm(16))
    ln = LayerNormMonitor(every_n_steps=1, keep_history=True)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, keep_history=True,
                                     loss_fn=lambda m, b: m.training_step(b, 0), scales=())
    t = trainer(2, [ln, inv], validate_every=2, precision="bf16-mixed", limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module)
    assert any("probes the first training batch" in str(w.message) for w in caught)
    assert [h["step"] for h in ln.history] == [0, 1]
    assert all(math.isfinite(v) for h in ln.history for v in h.values())
    assert 0 < ln.history[-1]["lnmonitor/share_median/norm"] < 1
    assert inv.history[0]["lnmonitor/invariance/shift_5/dloss"] == 0.0
    assert abs(inv.history[0]["lnmonitor/invariance/axis_5/dloss"]) > 0


def test_a_callback_reused_for_a_second_fit_logs_it():
    """The per-fit state (last logged step, the norms, the history) starts afresh at setup:
    the second fit's history is exactly what a fresh monitor logs for it."""
    mon, fresh = monitor(), monitor()
    fit(gpt(3), loader(12, 4), [mon], 3)
    fit(gpt(3, seed=1), loader(12, 4, seed=1), [mon], 3)
    fit(gpt(3, seed=1), loader(12, 4, seed=1), [fresh], 3)
    assert [h["step"] for h in mon.history] == [0, 1, 2]
    assert_close_history(mon.history, fresh.history, exact=True)


class PostNormed(TinyGPTModule):
    """OLMo2's pattern: each branch's output normed before it is added; no pre-norm."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        for block in self.model.blocks:
            block.post_attn = nn.LayerNorm(WIDTH)

    def forward(self, x, y=None):
        m = self.model
        h = m.tok_emb(x) + m.pos_emb(torch.arange(x.shape[1]))
        for block in m.blocks:
            h = h + block.post_attn(block.attn(h))
        logits = m.head(m.lnf(h))
        return logits, None if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_only_residual_stream_norms_are_rungs_and_ladder_overrides_it(caplog):
    module = PostNormed(VOCAB, width=WIDTH, depth=2, heads=2, context=CONTEXT, max_steps=2)
    mon = monitor(exclude=["*.ln1", "*.ln2"])  # the unused pre-norms of the tiny GPT
    _, caught = fit(module, loader(8, 4), [mon], 2)
    roles = {n.name: n.role for n in mon.norms}
    assert roles == {"model.blocks.0.post_attn": "post", "model.blocks.1.post_attn": "post",
                     "model.lnf": "final"}
    assert "lnmonitor/ladder/attenuation" not in mon.history[0]  # one rung: nothing to compare
    assert sum("the ladder has 1 rung(s)" in w for w in caught) == 1
    assert mon.history[0]["lnmonitor/share_median/model.blocks.0.post_attn"] > 0  # measured anyway
    named = monitor(exclude=["*.ln1", "*.ln2"], ladder=["model.blocks.*.post_attn", "model.lnf"])
    module = PostNormed(VOCAB, width=WIDTH, depth=2, heads=2, context=CONTEXT, max_steps=2)
    fit(module, loader(8, 4), [named], 2)
    assert [n.role for n in named.norms] == ["residual", "residual", "final"]
    h = named.history[0]
    assert h["lnmonitor/ladder/attenuation"] == pytest.approx(
        h["lnmonitor/inv_sigma/model.blocks.0.post_attn"] / h["lnmonitor/inv_sigma/model.lnf"], rel=1e-6)


class TinyRows(L.LightningModule):
    """Rows of variance 1e-12 through one LayerNorm: far below the old histogram's 1e-10."""

    def __init__(self):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(16, eps=1e-5), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.out(self.norm(1e-6 * x)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_variance_far_below_1e_10_is_read_not_clamped():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    x = (x - x.mean(1, keepdim=True)) / x.std(1, unbiased=False, keepdim=True)  # every row: var 1 -> 1e-12
    mon = monitor()
    fit(TinyRows(), DataLoader(TensorDataset(x), batch_size=64), [mon], 1)
    h = mon.history[0]
    assert h["lnmonitor/eps_over_var/norm"] == pytest.approx(1e7, rel=VAR_RESOLUTION)
    assert h["lnmonitor/rms/norm"] == pytest.approx(1e-6, rel=SIGMA_RESOLUTION)
    assert h["lnmonitor/transmission/norm"] == pytest.approx(1e-5 / (1e-12 + 1e-5), rel=1e-6)


def test_an_error_inside_a_hook_turns_the_monitor_off_and_training_goes_on(monkeypatch):
    import lnmonitor.core.meter.taps as taps

    def broken(*args):
        raise RuntimeError("a model the taps do not understand")

    monkeypatch.setattr(taps, "row_raw", broken)
    monkeypatch.setattr(taps, "layernorm_backward_raw", broken)
    mon = monitor()
    t, caught = fit(gpt(3), loader(12, 4), [mon], 3)
    assert t.global_step == 3 and mon.history == []
    said = [w for w in caught if "LayerNormMonitor is off" in w]
    assert len(said) == 1 and "a model the taps do not understand" in said[0]
    assert all(not m._forward_hooks for m in mon.norms[0].module.modules())


@pytest.mark.parametrize("finish", ["finish_rows", "finish_layernorm_backward"])
def test_an_error_finishing_the_rows_at_the_step_end_turns_the_monitor_off_and_training_goes_on(
        monkeypatch, finish):
    import lnmonitor.core.meter.taps as taps

    def broken(*args):
        raise RuntimeError("rows the taps cannot finish")

    monkeypatch.setitem(taps._FINISH, "rows" if finish == "finish_rows" else "layernorm", broken)
    mon = monitor()
    model = gpt(3, norm="rms" if finish == "finish_rows" else "layer")  # RMSNorm: the input path
    t, caught = fit(model, loader(12, 4), [mon], 3)
    assert t.global_step == 3 and mon.history == []
    said = [w for w in caught if "LayerNormMonitor is off" in w]
    assert len(said) == 1 and "rows the taps cannot finish" in said[0]


def test_a_resumed_fit_does_not_raise_a_finding_again(tmp_path):
    """The kinds raised are in the checkpoint: a fit resumed with ckpt_path is the same training,
    so a finding raised before the checkpoint is not raised again; a checkpoint from before
    findings were kept (no "findings" key) still loads, and then raises it anew."""
    every_step = {"stream_growth": 0.5}  # a growth every model has: raised at the first measured step

    def run(steps, ckpt_path=None, name="ckpt"):
        data, module = char_data(6)
        mon = monitor(findings=every_step, images=False, summary=False)
        save = ModelCheckpoint(dirpath=tmp_path / name, save_last=True, save_top_k=0)
        t = trainer(steps, [mon, save], logger=False, enable_checkpointing=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return mon, [w for w in caught if issubclass(w.category, lnmonitor.HealthWarning)]

    first, raised = run(3)
    assert len(raised) == 1 and [h["step"] for h in first.history] == [0, 1, 2]
    resumed, again = run(6, tmp_path / "ckpt" / "last.ckpt", name="ckpt2")
    assert again == [] and [h["step"] for h in resumed.history] == [3, 4, 5]
    assert all(h["lnmonitor/health/stream_growth"] == 1.0 for h in resumed.history)  # it still holds
    assert resumed.findings.raised["stream_growth"].step == 0  # raised at step 0, before the checkpoint

    old = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    for key, state in old["callbacks"].items():
        if key.startswith("LayerNormMonitor"):
            del state["findings"]
    torch.save(old, tmp_path / "old.ckpt")
    _, anew = run(6, tmp_path / "old.ckpt", name="ckpt3")
    assert len(anew) == 1  # nothing said it was raised: it is raised, once


def test_every_fit_logs_the_ladder_positions_and_layouts_a_fit_resumed_into_a_new_log_too(tmp_path):
    """A fit resumed from a checkpoint into a new TensorBoard version logs the ladder positions
    (at its first measured step) and both monitors' custom-scalars layouts there; resumed into
    the same log, the positions come again at a new step, and the log reads back as one run."""
    from lnmonitor.views.events import read_scalars
    from lnmonitor.views.summary import ladder_of, summary_text

    def run(steps, version, ckpt_path=None, name="ckpt"):
        data, module = char_data(8)
        tb = TensorBoardLogger(tmp_path, name="tb", version=version)
        callbacks = [LayerNormMonitor(every_n_steps=2, images=False, summary=False),
                     FinalNormInvarianceMonitor(invariance_every_n_steps=2, summary=False),
                     ModelCheckpoint(dirpath=tmp_path / name, save_last=True, save_top_k=0)]
        trainer(steps, callbacks, logger=tb, enable_checkpointing=True).fit(
            module, datamodule=data, ckpt_path=ckpt_path)
        return Path(tb.log_dir)

    def positions(log_dir):
        acc = events(log_dir)
        # sorted: the two event files of one version came back in either order (seen once, under load)
        return acc, {t: sorted(e.step for e in acc.Scalars(t)) for t in acc.Tags()["scalars"]
                     if t.startswith("lnmonitor/ladder_position/")}

    old = run(3, 0)  # measures 0 and 2, its last
    new = run(6, 1, tmp_path / "ckpt" / "last.ckpt", "ckpt2")  # measures 4 and 5
    acc, at = positions(new)
    assert at == {f"lnmonitor/ladder_position/{n}": [4] for n in NORMS}
    assert [acc.Scalars(f"lnmonitor/ladder_position/{n}")[0].value for n in NORMS] == [0, 1, 2, 3, 4]
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    layout = layout_pb2.Layout.FromString(
        acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == [
        "lnmonitor: 1/sigma ladder", "lnmonitor: dead-plane share", "lnmonitor: final-norm invariance"]

    run(6, 0, tmp_path / "ckpt" / "last.ckpt", "ckpt3")  # the same log again, from step 3
    _, at = positions(old)
    assert at == {f"lnmonitor/ladder_position/{n}": [0, 4] for n in NORMS}  # each step once
    curves = read_scalars(old)
    assert ladder_of(curves) == (NORMS, [])
    assert "the ladder at step 5 (4 measured steps, the first at 0" in summary_text(curves, "resumed")


class EmbeddingNormed(TinyGPTModule):
    """BLOOM's pattern, its norm registered last: the embeddings normed before the blocks, so
    module order ends with a norm that is not on the ladder."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.model.emb_norm = nn.LayerNorm(WIDTH)

    def forward(self, x, y=None):
        m = self.model
        h = m.emb_norm(m.tok_emb(x) + m.pos_emb(torch.arange(x.shape[1])))
        for block in m.blocks:
            h = block(h)
        logits = m.head(m.lnf(h))
        return logits, None if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


class FinalNormFirst(TinyGPTModule):
    """The final norm registered before the blocks: module order starts with it, the forward ends with it."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        m = self.model
        blocks, lnf, head = m.blocks, m.lnf, m.head
        del m.blocks, m.lnf, m.head
        m.lnf, m.blocks, m.head = lnf, blocks, head


def test_the_hparams_columns_name_the_final_norm_the_meter_finds(tmp_path):
    """The session is written when the fit starts, before a step shows the roles: its columns name
    the final norm the meter's rule expects then (an embedding norm registered last is none), a
    resumed fit's from the forward order in the checkpoint; when the first step finds another,
    that is said once, with the final_norm= that names it."""
    def run(cls, version, steps=3, ckpt_path=None, **kw):
        data, _ = char_data(8)
        module = cls(data.vocab.chars, width=WIDTH, depth=2, heads=2, context=CONTEXT, max_steps=8)
        mon = LayerNormMonitor(every_n_steps=2, images=False, summary=False, **kw)
        tb = TensorBoardLogger(tmp_path, name=cls.__name__, version=version)
        save = ModelCheckpoint(dirpath=tmp_path / f"{cls.__name__}{version}", save_last=True, save_top_k=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer(steps, [mon, save], logger=tb, enable_checkpointing=True).fit(
                module, datamodule=data, ckpt_path=ckpt_path)
        final = next(n.name for n in mon.norms if n.role == "final")
        said = [str(w.message) for w in caught if "HPARAMS tab's columns" in str(w.message)]
        return hparams_columns(tb.log_dir), final, said

    def named(norm):
        return [f"lnmonitor/log10_eps_over_var/{norm}", f"lnmonitor/share_median/{norm}"]

    columns, final, said = run(EmbeddingNormed, 0)
    assert final == "model.lnf" and set(named(final)) <= set(columns) and said == []
    assert not any("emb_norm" in c for c in columns)

    columns, final, said = run(FinalNormFirst, 0)  # module order cannot tell: said once
    assert final == "model.lnf" and set(named("model.blocks.1.ln2")) <= set(columns)
    assert len(said) == 1 and "the final norm is 'model.lnf'; pass final_norm='model.lnf'" in said[0]
    ckpt = tmp_path / "FinalNormFirst0" / "last.ckpt"
    columns, final, said = run(FinalNormFirst, 1, steps=6, ckpt_path=ckpt)  # resumed into a new log
    assert final == "model.lnf" and set(named(final)) <= set(columns) and said == []
    columns, _, said = run(FinalNormFirst, 2, final_norm="model.lnf")
    assert set(named("model.lnf")) <= set(columns) and said == []
