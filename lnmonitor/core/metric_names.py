"""The names lnmonitor logs under (part of the public interface, see docs/design.md).

Per norm: ``lnmonitor/<statistic>/<norm>`` with ``<norm>`` the module's qualified name in
the model the monitor was given; the ladder's ``lnmonitor/ladder/<statistic>``, and another
stack's ladder (an encoder-decoder's encoder) ``lnmonitor/ladder/<stack>/<statistic>``;
the invariance monitor under ``lnmonitor/invariance/``,
the structure probe under ``lnmonitor/probe/``, the findings under ``lnmonitor/health/``.
This module builds every one of them and reads them back (:func:`parse`, also under an
integration's prefix such as the ``train/`` TensorBoard puts before a transformers
Trainer's tags: :func:`unsplit`); it also holds the invariance cases and the
TensorBoard custom-scalars layouts, which are regexes over these names, so every run's
layout is the same.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = [
    "CATEGORY_ORDER", "HEADLINE_METRICS", "INVARIANCE", "INVARIANCE_CASES", "INVARIANCE_LAYOUT",
    "LADDER_LAYOUT", "PREFIX", "PROBE", "TRAINER_SPLIT", "Metric", "baseline_metric", "finite_metrics",
    "health_metric", "hist_metric", "invariance_metric", "ladder_metric", "parse", "per_norm", "probe_metric",
    "run_metric", "unsplit",
]

PREFIX = "lnmonitor"
INVARIANCE = f"{PREFIX}/invariance"
PROBE = f"{PREFIX}/probe"
# transformers.Trainer's TensorBoard and W&B integrations put this before every training log
TRAINER_SPLIT = "train"

# the final-norm invariance cases, logged as lnmonitor/invariance/<case>/...
INVARIANCE_CASES = ("shift_5", "shift_1000", "scale_3", "scale_3_shift_5", "axis_5")


# TensorBoard's HPARAMS table shows the first five metric columns of the session: these
# first (a name ending in "/" stands for every norm's)
HEADLINE_METRICS = (
    f"{PREFIX}/ladder/attenuation", f"{INVARIANCE}/scale_3/log10_abs_dloss", f"{PREFIX}/log10_eps_over_var/",
    f"{INVARIANCE}/scale_slope", f"{PREFIX}/share_median/",
)


def run_metric(name: str) -> str:
    """``lnmonitor/<name>``: a run's setting (``eps``, ``norm_kind``, ``final_norm``, ...) or
    picture (``ladder``, ``ladder_over_training``)."""
    return f"{PREFIX}/{name}"


def per_norm(statistic: str, norm: str) -> str:
    """``lnmonitor/<statistic>/<norm>``, e.g. ``lnmonitor/inv_sigma/model.lnf``."""
    return f"{PREFIX}/{statistic}/{norm}"


def ladder_metric(statistic: str, stack: str = "") -> str:
    """``lnmonitor/ladder/<statistic>`` for the model's ladder (the stack of the norm before the
    logits), ``lnmonitor/ladder/<stack>/<statistic>`` for another stack's, ``<stack>`` the
    qualified name of the module holding it: ``lnmonitor/ladder/model.encoder/attenuation``."""
    return f"{PREFIX}/ladder/{stack}/{statistic}" if stack else f"{PREFIX}/ladder/{statistic}"


def baseline_metric(statistic: str, norm: str = "") -> str:
    """``lnmonitor/share_baseline/<statistic>`` (``median`` or ``max``), one for every norm, or
    ``lnmonitor/share_baseline/<statistic>/<norm>`` when the norms' widths differ."""
    return f"{PREFIX}/share_baseline/{statistic}/{norm}" if norm else f"{PREFIX}/share_baseline/{statistic}"


def invariance_metric(statistic: str, case: str = "") -> str:
    """``lnmonitor/invariance/<case>/<statistic>`` (``dloss``, ``max_dlogit``, ...) of one case,
    ``lnmonitor/invariance/<statistic>`` of the sweep (``scale_slope``, ``scale_constant``, ...)."""
    return f"{INVARIANCE}/{case}/{statistic}" if case else f"{INVARIANCE}/{statistic}"


def probe_metric(statistic: str, name: str) -> str:
    """``lnmonitor/probe/<statistic>/<block or norm>`` of the structure probe."""
    return f"{PROBE}/{statistic}/{name}"


def health_metric(kind: str) -> str:
    """``lnmonitor/health/<kind>``: 1 while the finding ``kind`` holds, 0 after it ended
    (docs/findings.md), e.g. ``lnmonitor/health/stream_growth``."""
    return f"{PREFIX}/health/{kind}"


def hist_metric(statistic: str, norm: str) -> str:
    """``lnmonitor/hist/<statistic>/<norm>``: a histogram (``share``, ``sigma``)."""
    return f"{PREFIX}/hist/{statistic}/{norm}"


class Metric(NamedTuple):
    """A logged name read back: ``group`` says which builder made it (``norm``, ``ladder``,
    ``baseline``, ``invariance``, ``probe``, ``health``, ``hist``, ``run``), ``statistic`` what
    it measures, and ``name`` of what: the norm, the stack (``""``: the model's ladder), the
    invariance case (``""``: the sweep), the probe's block or norm (``""``: none)."""

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
    "run": lambda name, _: run_metric(name),
}
_GROUPS = {"share_baseline": "baseline", "invariance": "invariance", "probe": "probe", "health": "health",
           "hist": "hist"}


def unsplit(tag: str) -> str:
    """``tag`` without the split a transformers.Trainer integration puts before lnmonitor's
    names (``train/lnmonitor/sigma/x`` -> ``lnmonitor/sigma/x``); any other tag as it is."""
    split, _, name = tag.partition("/")
    return name if split == TRAINER_SPLIT and name.startswith(f"{PREFIX}/") else tag


def parse(tag: str) -> Metric | None:
    """The :class:`Metric` a logged name stands for (also under a transformers.Trainer's
    split, see :func:`unsplit`), or None when it is not lnmonitor's."""
    name = unsplit(tag)
    if not name.startswith(f"{PREFIX}/"):
        return None
    parts = name[len(PREFIX) + 1:].split("/")
    head, rest = parts[0], parts[1:]
    if not rest:
        return Metric("run", head)
    if head == "ladder":
        return Metric("ladder", rest[-1], "/".join(rest[:-1]))
    if head == "invariance":
        return Metric("invariance", rest[-1], "/".join(rest[:-1]))
    if head in _GROUPS:
        return Metric(_GROUPS[head], rest[0], "/".join(rest[1:]))
    return Metric("norm", head, "/".join(rest))


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The entries of ``metrics`` that are finite numbers (a monitor logs nothing it cannot
    stand behind; the missing ones are explained where they are computed)."""
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}


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
        "rows without gradient by construction": ["Multiline", [f"{PREFIX}/zero_grad_rows/.*"]],
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
