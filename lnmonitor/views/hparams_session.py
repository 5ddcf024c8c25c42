"""A run's HPARAMS-tab session, with the columns that matter in view.

TensorBoard's HPARAMS table shows five hyperparameter columns: those whose ``HParamInfo``
says ``differs`` first, then by name (``attention``, ``batch_size``, ``context``,
``decay``, ``depth`` for the tiny GPT, with eps and seed unticked), and the first five
metric columns in the session's order.  :func:`session_protos` marks the first five
of :data:`FIRST_HPARAMS` that the run has, so that they are the columns shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lnmonitor.core.metric_names import run_metric

__all__ = ["FIRST_HPARAMS", "SHOWN_HPARAMS", "session_protos"]

# how many hyperparameter columns TensorBoard's HPARAMS table shows before any is ticked
SHOWN_HPARAMS = 5
# preferred columns, most wanted first: the knobs an eps comparison turns, then what the
# monitors measured (a model of one's own has these), then the tiny GPT's other choices
FIRST_HPARAMS = (
    "eps", "seed", run_metric("eps"), run_metric("norm_kind"), run_metric("final_norm"), "norm", "init",
    "decay",
)


def session_protos(params: Mapping, metrics: Sequence[str]) -> list:
    """The experiment, session-start and session-end protos (TensorBoard's ``Summary``) of
    torch's ``hparams`` for ``params`` and the metric columns ``metrics`` (in that order), the first
    :data:`SHOWN_HPARAMS` of :data:`FIRST_HPARAMS` present in ``params`` marked so that
    TensorBoard shows them."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    from torch.utils.tensorboard.summary import hparams

    experiment, start, end = hparams(dict(params), {name: 0.0 for name in metrics})
    shown = [name for name in FIRST_HPARAMS if name in params][:SHOWN_HPARAMS]
    plugin_data = experiment.value[0].metadata.plugin_data
    content = HParamsPluginData.FromString(plugin_data.content)
    for info in content.experiment.hparam_infos:
        info.differs = info.name in shown
    plugin_data.content = content.SerializeToString()
    return [experiment, start, end]
