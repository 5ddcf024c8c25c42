"""The metric sink: the custom-scalars layout of every lnmonitor callback merged into one, one
HPARAMS session with the module's hyperparameters, histograms."""

from __future__ import annotations

import pytest
from conftest import (
    CONTEXT,
    WIDTH,
    char_data,
    events,
    fit,
    gpt,
    loader,
    trainer,
)
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.callbacks.sink import MetricSink


def test_tensorboard_layout_hparams_and_histograms(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    data, module = char_data(3)
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [
        LayerNormMonitor(every_n_steps=1, histograms=True),
        FinalNormInvarianceMonitor(every_n_steps=2, on_validation=False),
    ]
    trainer(3, validate_every=3, callbacks=callbacks, logger=tb).fit(module, datamodule=data)
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
    assert h.num == 4 * CONTEXT and 0.0 <= h.min <= h.max <= 1.0


def test_per_logger_state_is_keyed_by_the_logger_itself_never_its_id(tmp_path):
    """A callback reused with a new logger writes that run's layout, and what it remembers
    about a logger dies with the logger, so a new object at a recycled address is new to it."""
    import gc

    ln = LayerNormMonitor(every_n_steps=1)
    for name in ("a", "b"):
        logger = TensorBoardLogger(tmp_path, name=name, default_hp_metric=False)
        fit(gpt(1), loader(4, 4), [ln], 1, logger=logger)
        assert "custom_scalars__config__" in events(logger.log_dir).Tags()["tensors"], name
    sink = MetricSink("test", keep_history=None)
    gone = TensorBoardLogger(tmp_path, name="c")
    sink._ready.add(gone)
    del gone
    gc.collect()
    assert len(sink._ready) == 0
