"""The names lnmonitor logs under (public interface, docs/design.md), built and read back (:func:`parse`).

Per norm ``lnmonitor/<statistic>/<norm>`` (``<norm>`` the module's qualified name in the model); the ladder's
``lnmonitor/ladder/<statistic>`` (another stack's, an encoder-decoder's encoder:
``lnmonitor/ladder/<stack>/<statistic>``); the invariance monitor's ``lnmonitor/invariance/...``, the
structure probe's ``lnmonitor/probe/...``, the findings' ``lnmonitor/health/...``.  Also the invariance
cases and the TensorBoard custom-scalars layouts (regexes over the names).  What each name means, in which
units: docs/metrics.md (written by tools/metrics_doc.py).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "CATEGORY_ORDER", "FINAL", "HEADLINE_METRICS", "INVARIANCE", "INVARIANCE_CASES",
    "INVARIANCE_LAYOUT", "LADDER_LAYOUT", "PREFIX", "PROBE", "TRAINER_SPLIT", "TRAIN_LOSS", "VAL_LOSS",
    "Metric", "baseline_metric", "custom_scalars", "final_metric", "health_metric",
    "hist_metric", "invariance_metric", "ladder_metric", "parse", "per_norm", "probe_metric", "run_metric",
    "unsplit",
]

PREFIX = "lnmonitor"
INVARIANCE = f"{PREFIX}/invariance"
PROBE = f"{PREFIX}/probe"
# transformers.Trainer's TensorBoard and W&B integrations put this before every training log
TRAINER_SPLIT = "train"

# the tiny recipe's losses (its LightningModule logs them), and the prefix of an experiment's
# headline figures of a finished run (final/<key>, lnmonitor.experiments.eps.run.log_final)
TRAIN_LOSS, VAL_LOSS = "train/loss", "val/loss"
FINAL = "final"

# the final-norm invariance cases, logged as lnmonitor/invariance/<case>/...
INVARIANCE_CASES = ("shift_5", "shift_1000", "scale_3", "scale_3_shift_5", "axis_5")
# the case no norm is invariant to (a shift of one coordinate): the scale the others' zeros are read against
INVARIANCE_CONTROLS = ("axis_5",)

# TensorBoard's HPARAMS table shows the first five metric columns: these (a name ending in "/": every norm's)
HEADLINE_METRICS = (
    f"{PREFIX}/ladder/attenuation", f"{INVARIANCE}/scale_3/log10_abs_dloss", f"{PREFIX}/log10_eps_over_var/",
    f"{INVARIANCE}/scale_slope", f"{PREFIX}/share_median/",
)


def run_metric(name: str) -> str:
    """``lnmonitor/<name>``: a run's setting (``eps``, ``norm_kind``, ...) or picture (``ladder``, ...)."""
    return f"{PREFIX}/{name}"


def per_norm(statistic: str, norm: str) -> str:
    """``lnmonitor/<statistic>/<norm>``, e.g. ``lnmonitor/inv_sigma/model.lnf``."""
    return f"{PREFIX}/{statistic}/{norm}"


def ladder_metric(statistic: str, stack: str = "") -> str:
    """``lnmonitor/ladder/<statistic>`` for the model's ladder (the stack of the norm before the logits),
    ``lnmonitor/ladder/<stack>/<statistic>`` for another's: ``lnmonitor/ladder/model.encoder/attenuation``."""
    return f"{PREFIX}/ladder/{stack}/{statistic}" if stack else f"{PREFIX}/ladder/{statistic}"


def baseline_metric(statistic: str, norm: str = "") -> str:
    """``lnmonitor/share_baseline/<statistic>`` (``median`` or ``max``), one for every norm, or
    ``lnmonitor/share_baseline/<statistic>/<norm>`` when the norms' widths differ."""
    return f"{PREFIX}/share_baseline/{statistic}/{norm}" if norm else f"{PREFIX}/share_baseline/{statistic}"


def invariance_metric(statistic: str, case: str = "") -> str:
    """``lnmonitor/invariance/<case>/<statistic>`` of one case, ``lnmonitor/invariance/<statistic>`` of the
    scale sweep."""
    return f"{INVARIANCE}/{case}/{statistic}" if case else f"{INVARIANCE}/{statistic}"


def probe_metric(statistic: str, name: str) -> str:
    """``lnmonitor/probe/<statistic>/<block or norm>`` of the structure probe."""
    return f"{PROBE}/{statistic}/{name}"


def health_metric(kind: str) -> str:
    """``lnmonitor/health/<kind>``: 1 while the finding ``kind`` holds, 0 after it ended."""
    return f"{PREFIX}/health/{kind}"


def final_metric(key: str) -> str:
    """``final/<key>``: an eps-comparison run's headline figure, logged once at its last step."""
    return f"{FINAL}/{key}"


def hist_metric(statistic: str, norm: str) -> str:
    """``lnmonitor/hist/<statistic>/<norm>``: a histogram (``share``, ``sigma``)."""
    return f"{PREFIX}/hist/{statistic}/{norm}"


class Metric(NamedTuple):
    """A logged name read back: ``group`` the builder that made it (``norm``, ``ladder``, ``baseline``,
    ``invariance``, ``probe``, ``health``, ``hist``, ``run``, ``final``), ``statistic`` what it measures,
    ``name`` of what: the norm, the stack or invariance case (``""``: the model's ladder, the sweep), the
    probe's block or norm."""

    group: str
    statistic: str
    name: str = ""

    @property
    def tag(self) -> str:
        """The name this metric is logged under (``parse(m.tag) == m``)."""
        return _BUILD[self.group](self.statistic, self.name)


_BUILD = {
    "norm": per_norm, "ladder": ladder_metric, "baseline": baseline_metric, "invariance": invariance_metric,
    "probe": probe_metric, "health": lambda kind, _: health_metric(kind), "hist": hist_metric,
    "run": lambda name, _: run_metric(name), "final": lambda key, _: final_metric(key),
}
_GROUPS = {"share_baseline": "baseline", "probe": "probe", "health": "health", "hist": "hist"}


def unsplit(tag: str) -> str:
    """``tag`` without the split a transformers.Trainer integration puts before lnmonitor's names
    (``train/lnmonitor/sigma/x`` -> ``lnmonitor/sigma/x``); any other tag as it is."""
    split, _, name = tag.partition("/")
    return name if split == TRAINER_SPLIT and name.startswith(f"{PREFIX}/") else tag


def parse(tag: str) -> Metric | None:
    """The :class:`Metric` a logged name stands for (also under a Trainer's split; ``final/<key>`` too), or
    None when it is not lnmonitor's."""
    name = unsplit(tag)
    if name.startswith(f"{FINAL}/"):
        return Metric("final", name[len(FINAL) + 1:])
    if not name.startswith(f"{PREFIX}/"):
        return None
    parts = name[len(PREFIX) + 1:].split("/")
    head, rest = parts[0], parts[1:]
    if not rest:
        return Metric("run", head)
    if head in ("ladder", "invariance"):
        return Metric(head, rest[-1], "/".join(rest[:-1]))
    if head in _GROUPS:
        return Metric(_GROUPS[head], rest[0], "/".join(rest[1:]))
    return Metric("norm", head, "/".join(rest))


# The custom-scalars layouts (TensorBoard's Custom Scalars tab): charts by regex over the names.
LADDER_LAYOUT = {
    "lnmonitor: 1/sigma ladder": {
        "1/sigma by norm": ["Multiline", [f"{PREFIX}/inv_sigma/.*"]],
        "rms of the stream each norm reads": ["Multiline", [f"{PREFIX}/rms/.*"]],
        "log10 eps/var by norm": ["Multiline", [f"{PREFIX}/log10_eps_over_var/.*"]],
        "log10 transmission eps/(var+eps) by norm": ["Multiline", [f"{PREFIX}/log10_transmission/.*"]],
        "ladder attenuation and growth": ["Multiline", [f"{PREFIX}/ladder/.*"]],
    },
    "lnmonitor: dead-plane share": {
        "median share vs random median": [
            "Multiline", [f"{PREFIX}/share_median/.*", f"{PREFIX}/share_baseline/median.*"]],
        "p90 share": ["Multiline", [f"{PREFIX}/share_p90/.*"]],
        "max share vs random max": [
            "Multiline", [f"{PREFIX}/share_max/.*", f"{PREFIX}/share_baseline/max.*"]],
        "skipped rows (faults: non-finite or constant)": ["Multiline", [f"{PREFIX}/skipped_rows/.*"]],
        "rows without a target (no gradient)": ["Multiline", [f"{PREFIX}/zero_grad_rows/.*"]],
        "rows whose gradient vanished (a fault)": ["Multiline", [f"{PREFIX}/vanished_grad_rows/.*"]],
    },
}

INVARIANCE_LAYOUT = {
    "lnmonitor: final-norm invariance": {
        "log10 |delta-loss| by case": ["Multiline", [f"{INVARIANCE}/[^/]+/log10_abs_dloss"]],
        "delta-loss by case": ["Multiline", [f"{INVARIANCE}/[^/]+/dloss$"]],
        "max |delta-logit| by case": ["Multiline", [f"{INVARIANCE}/[^/]+/max_dlogit"]],
        "float64 norm-output residual by case": ["Multiline", [f"{INVARIANCE}/[^/]+/out_residual"]],
        "scale sweep: slope and constant": ["Multiline", [f"{INVARIANCE}/scale_(slope|constant)"]],
    },
}

# the order of lnmonitor's custom-scalars categories in TensorBoard
CATEGORY_ORDER = (*LADDER_LAYOUT, *INVARIANCE_LAYOUT)


def custom_scalars(probed: bool, prefix: str = "") -> dict[str, dict]:
    """The Custom Scalars layout of a run (the invariance charts too when ``probed``), each regex after
    ``prefix`` (the ``train/`` a Trainer's TensorBoard puts before every tag)."""
    categories = {**LADDER_LAYOUT, **(INVARIANCE_LAYOUT if probed else {})}
    return {name: {chart: [kind, [prefix + regex for regex in regexes]]
                   for chart, (kind, regexes) in categories[name].items()}
            for name in CATEGORY_ORDER if name in categories}
