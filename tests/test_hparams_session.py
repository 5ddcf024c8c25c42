"""The HPARAMS session: eps, seed and the monitors' own columns are among the five
hyperparameter columns TensorBoard shows, in TensorBoard's own order (its backend sorts the
experiment's hyperparameters, and its table ticks the first five)."""

from __future__ import annotations

from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.plugins.hparams.backend_context import _sort_and_reduce_to_hparams_limit

from lnmonitor.hparams_session import SHOWN_HPARAMS, session_summaries

# the hyperparameters of a train-tiny run's session: the module's, the datamodule's, the monitors'
TRAIN_TINY = {
    "width": 128, "depth": 4, "heads": 4, "context": 64, "norm": "layer", "eps": 1e-5, "attention": "sdpa",
    "lr": 3e-3, "weight_decay": 0.1, "max_steps": 3000, "decay": "all", "init": "default", "batch_size": 32,
    "seed": 0, "val_fraction": 0.1, "val_windows": 256, "lnmonitor/norm_kind": "layer", "lnmonitor/eps": 1e-5,
    "lnmonitor/width": 128, "lnmonitor/n_norms": 9, "lnmonitor/every_n_steps": 50,
    "lnmonitor/final_norm": "auto",
}


def shown_by_tensorboard(experiment_summary) -> list[str]:
    content = plugin_data_pb2.HParamsPluginData.FromString(
        experiment_summary.value[0].metadata.plugin_data.content)
    _sort_and_reduce_to_hparams_limit(content.experiment)
    return [info.name for info in content.experiment.hparam_infos][:SHOWN_HPARAMS]


def test_eps_seed_and_the_monitors_columns_are_the_ones_shown():
    from torch.utils.tensorboard.summary import hparams

    plain = shown_by_tensorboard(hparams(TRAIN_TINY, {"lnmonitor/ladder/attenuation": 0.0})[0])
    assert "eps" not in plain and "seed" not in plain  # torch's own session hides them
    shown = shown_by_tensorboard(session_summaries(TRAIN_TINY, ["lnmonitor/ladder/attenuation"])[0])
    assert sorted(shown) == ["eps", "lnmonitor/eps", "lnmonitor/final_norm", "lnmonitor/norm_kind", "seed"]


def test_a_model_of_ones_own_shows_the_monitors_columns_and_then_its_own_by_name():
    params = {"lr": 1e-3, "hidden": 512, "lnmonitor/eps": 1e-6, "lnmonitor/norm_kind": "rms",
              "lnmonitor/final_norm": "auto", "lnmonitor/width": 512}
    shown = shown_by_tensorboard(session_summaries(params, ["m"])[0])
    assert shown == ["lnmonitor/eps", "lnmonitor/final_norm", "lnmonitor/norm_kind", "hidden", "lnmonitor/width"]


def test_the_session_keeps_its_values_and_metric_order():
    summaries = session_summaries(TRAIN_TINY, ["b", "a"])
    data = [plugin_data_pb2.HParamsPluginData.FromString(s.value[0].metadata.plugin_data.content)
            for s in summaries]
    assert [m.name.tag for m in data[0].experiment.metric_infos] == ["b", "a"]
    assert data[1].session_start_info.hparams["seed"].number_value == 0
    assert data[1].session_start_info.hparams["norm"].string_value == "layer"
