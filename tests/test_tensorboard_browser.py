"""TensorBoard in a real headless Chromium on two short runs (different eps, different norm
sets): the three lnmonitor sections of Custom Scalars with each chart once, the ladder
pictures in Images, the headline metric columns in HPARAMS.

Skips, saying why, where no browser can be had (``.ci/run`` installs chromium and
chromium-driver from the system packages when they are missing)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from conftest import char_data, trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import board  # noqa: E402


def test_tensorboard_shows_the_lnmonitor_sections_pictures_and_columns(tmp_path):
    try:
        browser = board.browser()
        driver = browser.__enter__()
    except board.NoBrowser as err:
        pytest.skip(f"no browser for the TensorBoard test: {err}")
    try:
        for name, eps, include in (("a", 1e-5, None), ("b", 1e-1, ["*.ln1", "model.lnf"])):
            data, module = char_data(6, eps=eps)
            callbacks = [LayerNormMonitor(every_n_steps=2, include=include),
                         FinalNormInvarianceMonitor(invariance_every_n_steps=3)]
            logger = TensorBoardLogger(tmp_path, name=name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer(6, callbacks, logger=logger).fit(module, datamodule=data)
        sections = ["lnmonitor: 1/sigma ladder", "lnmonitor: dead-plane share",
                    "lnmonitor: final-norm invariance"]
        with board.serve(tmp_path) as url:
            text, _ = board.open_dashboard(driver, url, "custom_scalars", sections)
            assert all(s in text for s in sections), text[:2000]
            # the two runs' layouts are the same, so TensorBoard shows each chart once
            assert text.count("1/sigma by norm") == 1 and text.count("log10 |delta-loss| by case") == 1

            tags = ["lnmonitor/ladder", "lnmonitor/ladder_over_training"]
            text, pictures = board.open_dashboard(driver, url, "images", tags, images=2)
            assert all(t in text for t in tags), text[:2000]
            widths = sorted(w for _, w in pictures)
            assert len(widths) == 4 and widths.count(480) == 2, pictures  # both runs' pictures, decoded

            headline = ["lnmonitor/ladder/attenuation", "lnmonitor/invariance/scale_3/log10_abs_dloss"]
            board.open_dashboard(driver, url, "hparams", headline)
            shown = board.checkboxes(driver)
            # the headline metrics are among the five metric columns TensorBoard shows
            assert all(shown.get(h) for h in headline), shown
    finally:
        browser.__exit__(None, None, None)
