"""A run's HPARAMS-tab session, with the columns that matter in view.

TensorBoard's HPARAMS table shows five hyperparameter columns, those marked ``differs`` first, then by
name; :func:`session_protos` marks the first five of :data:`FIRST_HPARAMS` that the run has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lnmonitor.core.output.metric_names import ladder_metric, per_norm, run_metric

__all__ = ["FIRST_HPARAMS", "SHOWN_HPARAMS", "columns_message", "monitor_columns", "session_protos"]

SHOWN_HPARAMS = 5  # hyperparameter columns TensorBoard's HPARAMS table shows before any is ticked
# preferred columns, most wanted first: an eps comparison's knobs, what the monitors measured, the tiny GPT's
FIRST_HPARAMS = ("eps", "seed", run_metric("eps"), run_metric("norm_kind"), run_metric("final_norm"), "norm",
                 "init", "decay")


def session_protos(params: Mapping, metrics: Sequence[str]) -> list:
    """The experiment, session-start and session-end ``Summary`` protos of torch's ``hparams`` for
    ``params`` and the metric columns ``metrics``, the preferred columns marked to be shown."""
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


def monitor_columns(norms: Sequence, dtype, every_n_steps: int | None,
                    final: str | None) -> tuple[dict, list[str]]:
    """The LayerNormMonitor's share of a run's session, ``(hparams, metric columns)``: the norms' kind, eps
    (in ``dtype``), width, count and the cadence; the ladder's attenuation and growth and, when ``final``
    names the final norm expected, its log10 eps/var and median share."""
    epss = sorted({n.eps(dtype) for n in norms})
    widths = sorted({n.width for n in norms if n.width is not None})
    params = {
        run_metric("norm_kind"): ",".join(sorted({n.kind for n in norms})),
        run_metric("eps"): epss[0] if len(epss) == 1 else ",".join(f"{e:g}" for e in epss),
        run_metric("width"): widths[0] if len(widths) == 1 else ",".join(map(str, widths)),
        run_metric("n_norms"): len(norms),
        run_metric("every_n_steps"): every_n_steps,
    }
    metrics = [ladder_metric("attenuation"), ladder_metric("growth")]
    if final is not None:
        metrics[1:1] = [per_norm("log10_eps_over_var", final), per_norm("share_median", final)]
    return params, metrics


def columns_message(name: str, named: str, final: str | None) -> str:
    """The warning when the session's columns name ``named`` but a measured step found the final norm to
    be ``final`` (None: none)."""
    found = (f"the final norm is {final!r}; pass final_norm={final!r} to have its columns there" if final
             else "the model has no final norm (the last norm's input flows on past it)")
    return (f"{name}: the HPARAMS tab's columns show {named!r}'s eps/var and share, the final norm "
            "expected when the fit started (TensorBoard keeps the session written then, before a step "
            f"could show the roles), but {found}. Said once.")
