"""The names lnmonitor logs under (part of the public interface, see docs/design.md).

Per norm: ``lnmonitor/<statistic>/<norm>`` with ``<norm>`` the module's qualified name in
the model the monitor was given; the ladder's ``lnmonitor/ladder/<statistic>``, and another
stack's ladder (an encoder-decoder's encoder) ``lnmonitor/ladder/<stack>/<statistic>``;
the invariance monitor under ``lnmonitor/invariance/``,
the structure probe under ``lnmonitor/probe/``.  This module also holds the invariance
cases and the TensorBoard custom-scalars layouts, which are regexes over these names, so
every run's layout is the same.
"""

from __future__ import annotations

import math

__all__ = [
    "CATEGORY_ORDER", "HEADLINE_METRICS", "INVARIANCE", "INVARIANCE_CASES", "INVARIANCE_LAYOUT",
    "LADDER_LAYOUT", "PREFIX", "PROBE", "TRAINER_SPLIT", "finite_metrics", "health_metric", "ladder_metric",
    "per_norm", "unsplit",
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


def per_norm(statistic: str, norm: str) -> str:
    """``lnmonitor/<statistic>/<norm>``, e.g. ``lnmonitor/inv_sigma/model.lnf``."""
    return f"{PREFIX}/{statistic}/{norm}"


def ladder_metric(statistic: str, stack: str = "") -> str:
    """``lnmonitor/ladder/<statistic>`` for the model's ladder (the stack of the norm before the
    logits), ``lnmonitor/ladder/<stack>/<statistic>`` for another stack's, ``<stack>`` the
    qualified name of the module holding it: ``lnmonitor/ladder/model.encoder/attenuation``."""
    return f"{PREFIX}/ladder/{stack}/{statistic}" if stack else f"{PREFIX}/ladder/{statistic}"


def unsplit(tag: str) -> str:
    """``tag`` without the split a transformers.Trainer integration puts before lnmonitor's
    names (``train/lnmonitor/sigma/x`` -> ``lnmonitor/sigma/x``); any other tag as it is."""
    split, _, name = tag.partition("/")
    return name if split == TRAINER_SPLIT and name.startswith(f"{PREFIX}/") else tag


def health_metric(kind: str) -> str:
    """``lnmonitor/health/<kind>``: 1 while the finding ``kind`` holds, 0 after it ended
    (docs/findings.md), e.g. ``lnmonitor/health/stream_growth``."""
    return f"{PREFIX}/health/{kind}"


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
