"""The Lightning callbacks' Loggers: the custom-scalars layout of every lnmonitor callback merged
into one, one HPARAMS session with the module's hyperparameters, histograms."""

from __future__ import annotations

import re

import pytest
from conftest import (
    CONTEXT,
    NORMS,
    WIDTH,
    char_data,
    events,
    fit,
    gpt,
    hparams_columns,
    loader,
    trainer,
)
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.invariance.results import CASES
from lnmonitor.lightning.loggers import Loggers


def test_tensorboard_layout_hparams_and_histograms(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    data, module = char_data(3)
    tb = TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [
        LayerNormMonitor(every_n_steps=1, histograms=True),
        FinalNormInvarianceMonitor(invariance_every_n_steps=2, on_validation=False),
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
    logged = acc.Tags()["scalars"]

    def matched(chart: str) -> list[str]:  # TensorBoard matches a chart's regexes with re.match
        return sorted(t for t in logged if any(re.match(rx, t) for rx in charts[chart]))

    assert matched("1/sigma by norm") == sorted(f"lnmonitor/inv_sigma/{n}" for n in NORMS)
    assert "lnmonitor/share_baseline/median" in matched("median share vs random median")
    assert matched("delta-loss by case") == sorted(f"lnmonitor/invariance/{c}/dloss" for c in CASES)
    # exactly zero (the shifts of a LayerNorm) has no log10: only the other three cases
    assert matched("log10 |delta-loss| by case") == sorted(
        f"lnmonitor/invariance/{c}/log10_abs_dloss" for c in ("scale_3", "scale_3_shift_5", "axis_5"))

    ssi = acc.SummaryMetadata("_hparams_/session_start_info")
    info = plugin_data_pb2.HParamsPluginData.FromString(ssi.plugin_data.content).session_start_info
    assert info.hparams["lnmonitor/eps"].number_value == pytest.approx(1e-5)
    assert info.hparams["lnmonitor/norm_kind"].string_value == "layer"
    assert info.hparams["lnmonitor/final_norm"].string_value == "auto"
    assert info.hparams["width"].number_value == WIDTH  # the module's own hparams survive
    assert info.hparams["seed"].number_value == 0 and info.hparams["batch_size"].number_value == 4
    assert len(module.hparams.vocab) > 64 and "vocab" not in info.hparams  # a long string: no column
    names = hparams_columns(tb.log_dir)
    # TensorBoard shows the first five metric columns: the headline ones, readable numbers
    assert names[:5] == [
        "lnmonitor/ladder/attenuation", "lnmonitor/invariance/scale_3/log10_abs_dloss",
        "lnmonitor/log10_eps_over_var/model.lnf", "lnmonitor/invariance/scale_slope",
        "lnmonitor/share_median/model.lnf",
    ]
    assert names[-1] == "hp_metric"

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
    loggers = Loggers("test", keep_history=None)
    gone = TensorBoardLogger(tmp_path, name="c")
    loggers._ready.add(gone)
    del gone
    gc.collect()
    assert len(loggers._ready) == 0


def test_a_callbacks_warning_points_at_the_users_fit_line_not_lnmonitors():
    import warnings

    data, module = char_data(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(1, [LayerNormMonitor(images=False, summary=False)]).fit(module, datamodule=data)
    said = [w for w in caught if "the Trainer has no logger" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, (said[0].filename, said[0].lineno)
