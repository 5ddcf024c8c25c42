"""The HPARAMS session: eps, seed and the monitors' own columns are among the five
hyperparameter columns TensorBoard shows, in TensorBoard's own order (its backend sorts the
experiment's hyperparameters, and its table ticks the first five)."""

from __future__ import annotations

from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.plugins.hparams.backend_context import _sort_and_reduce_to_hparams_limit

from lnmonitor.views.hparams_session import SHOWN_HPARAMS, session_protos

# the hyperparameters of a train-tiny run's session: the module's, the datamodule's, the monitors'
TRAIN_TINY = {
    "width": 128, "depth": 4, "heads": 4, "context": 64, "norm": "layer", "eps": 1e-5, "attention": "sdpa",
    "lr": 3e-3, "weight_decay": 0.1, "max_steps": 3000, "decay": "all", "init": "default", "batch_size": 32,
    "seed": 0, "val_fraction": 0.1, "val_windows": 256, "lnmonitor/norm_kind": "layer", "lnmonitor/eps": 1e-5,
    "lnmonitor/width": 128, "lnmonitor/n_norms": 9, "lnmonitor/every_n_steps": 50,
    "lnmonitor/final_norm": "auto",
}


def shown_by_tensorboard(metadata) -> list[str]:
    """The hyperparameter columns TensorBoard shows for an experiment's summary metadata."""
    content = plugin_data_pb2.HParamsPluginData.FromString(metadata.plugin_data.content)
    _sort_and_reduce_to_hparams_limit(content.experiment)
    return [info.name for info in content.experiment.hparam_infos][:SHOWN_HPARAMS]


def test_eps_seed_and_the_monitors_columns_are_the_ones_shown():
    from torch.utils.tensorboard.summary import hparams

    metric = "lnmonitor/ladder/attenuation"
    plain = shown_by_tensorboard(hparams(TRAIN_TINY, {metric: 0.0})[0].value[0].metadata)
    assert "eps" not in plain and "seed" not in plain  # torch's own session hides them
    shown = shown_by_tensorboard(session_protos(TRAIN_TINY, [metric])[0].value[0].metadata)
    assert sorted(shown) == ["eps", "lnmonitor/eps", "lnmonitor/final_norm", "lnmonitor/norm_kind", "seed"]


def test_a_model_of_ones_own_shows_the_monitors_columns_and_then_its_own_by_name():
    params = {"lr": 1e-3, "hidden": 512, "lnmonitor/eps": 1e-6, "lnmonitor/norm_kind": "rms",
              "lnmonitor/final_norm": "auto", "lnmonitor/width": 512}
    shown = shown_by_tensorboard(session_protos(params, ["m"])[0].value[0].metadata)
    assert shown == ["lnmonitor/eps", "lnmonitor/final_norm", "lnmonitor/norm_kind",  # marked, by name
                     "hidden", "lnmonitor/width"]  # then the rest by name


def test_the_session_keeps_its_values_and_metric_order():
    protos = session_protos(TRAIN_TINY, ["b", "a"])
    data = [plugin_data_pb2.HParamsPluginData.FromString(s.value[0].metadata.plugin_data.content)
            for s in protos]
    assert [m.name.tag for m in data[0].experiment.metric_infos] == ["b", "a"]
    assert data[1].session_start_info.hparams["seed"].number_value == 0
    assert data[1].session_start_info.hparams["norm"].string_value == "layer"


def test_an_eps_compare_run_shows_the_grids_knobs(tmp_path):
    from conftest import events
    from lightning.pytorch.loggers import TensorBoardLogger

    from lnmonitor.experiments.eps.run import write_hparams_session
    from lnmonitor.tiny.recipe import Recipe

    logger = TensorBoardLogger(tmp_path, name="run", default_hp_metric=False)
    write_hparams_session(logger, Recipe(eps=0.1, seed=3), monitor=True)
    shown = shown_by_tensorboard(events(logger.log_dir).SummaryMetadata("_hparams_/experiment"))
    assert sorted(shown) == ["decay", "eps", "init", "norm", "seed"]


def test_a_monitored_fit_shows_eps_and_seed(tmp_path):
    from conftest import char_data, events, trainer
    from lightning.pytorch.loggers import TensorBoardLogger

    from lnmonitor import LayerNormMonitor

    data, module = char_data(2)
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer(2, [LayerNormMonitor()], logger=logger).fit(module, datamodule=data)
    shown = shown_by_tensorboard(events(logger.log_dir).SummaryMetadata("_hparams_/experiment"))
    assert {"eps", "seed", "lnmonitor/eps"} <= set(shown)

