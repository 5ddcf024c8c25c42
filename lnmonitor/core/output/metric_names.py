"""The names lnmonitor logs under (public interface, docs/design.md), built and read back (:func:`parse`).

Per norm ``lnmonitor/<statistic>/<norm>`` (``<norm>`` the module's qualified name in the model); the ladder's
``lnmonitor/ladder/<statistic>`` (another stack's, an encoder-decoder's encoder:
``lnmonitor/ladder/<stack>/<statistic>``); the invariance monitor's ``lnmonitor/invariance/...``, the
structure probe's ``lnmonitor/probe/...``, the findings' ``lnmonitor/health/...``.  Also the invariance
cases and the TensorBoard custom-scalars layouts (regexes over the names).  :data:`FAMILIES` says what each
name means, in which units: docs/metrics.md is generated from it (``python -m lnmonitor.views.metric_table``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "CATEGORY_ORDER", "FAMILIES", "FINAL", "HEADLINE_METRICS", "INVARIANCE", "INVARIANCE_CASES",
    "INVARIANCE_LAYOUT", "LADDER_LAYOUT", "PREFIX", "PROBE", "TRAINER_SPLIT", "TRAIN_LOSS", "VAL_LOSS",
    "Family", "Metric", "baseline_metric", "custom_scalars", "family_of", "final_metric", "health_metric",
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


class Family(NamedTuple):
    """Logged names of one meaning: ``names`` with placeholders (``<norm>``: a norm's qualified name,
    ``<case>``: an invariance case, ``<stack>``: the module holding another stack, ``<kind>``: a finding,
    ``<block>``: a residual block), what they mean, in which units."""

    names: tuple[str, ...]
    meaning: str
    units: str

    def matches(self, tag: str) -> bool:
        """Whether the logged name ``tag`` (also under a Trainer's split) is one of this family's."""
        return any(_family_regex(name).fullmatch(unsplit(tag)) for name in self.names)


_PLACEHOLDERS = {"<norm>": r"[\w.\-]+", "<stack>": r"[\w.\-]+", "<block>": r"[\w.\-]+",
                 "<case>": "(" + "|".join(INVARIANCE_CASES) + ")", "<kind>": "[a-z_]+"}


def _family_regex(name: str) -> re.Pattern:
    text = re.escape(name)
    for holder, regex in _PLACEHOLDERS.items():
        text = text.replace(re.escape(holder), regex)
    return re.compile(text)


def family_of(tag: str) -> Family | None:
    """The :class:`Family` of a logged name, or None when no family holds it."""
    return next((f for f in FAMILIES if f.matches(tag)), None)


def _n(statistic: str) -> str:
    return per_norm(statistic, "<norm>")


_SWEEP = "{" + ", ".join(("1e3", "1e1", "1", "1e-1", "1e-2", "3e-3", "1e-3", "1e-4")) + "}"

# every name lnmonitor logs, by meaning (docs/metrics.md is this table)
FAMILIES = (
    Family((_n("sigma"),), "median `sqrt(v + eps)` of the norm's input rows", "input units"),
    Family((_n("inv_sigma"),), "`1/sigma`: the factor every surviving gradient direction is multiplied by; "
           "one rung of the ladder", "1/input units"),
    Family((_n("rms"),), "median rms of the residual stream the norm reads", "input units"),
    Family((_n("eps_over_var"), _n("log10_eps_over_var")),
           "median `eps / v`, and its log10 (it spans decades)", "ratio"),
    Family((_n("transmission"), _n("log10_transmission")),
           "median `eps/(v+eps)`: what the Jacobian passes along `xhat` (~1e-5 normally, ~0.1 at eps = 0.1), "
           "and its log10", "ratio"),
    Family((_n("share_median"), _n("share_p90"), _n("share_max")),
           "dead-plane share `|P w|/|w|`, P the projector onto span{1, xhat} (RMSNorm: span{xhat}): median, "
           "90th percentile, exact maximum. Deleting a share s shortens the gradient by `1 - sqrt(1 - s^2)` "
           "(s = 0.105 costs 0.55%)", "0..1"),
    Family((baseline_metric("median"),), "median share of a uniformly random direction at this width and "
           "dead dimension (0.1046 at d = 128, k = 2)", "0..1"),
    Family((baseline_metric("max"),), "median of the maximum of as many random rows as were measured: what "
           "`share_max` should be compared with", "0..1"),
    Family((baseline_metric("median", "<norm>"), baseline_metric("max", "<norm>")),
           "the same, one per norm, when the norms' widths or kinds differ", "0..1"),
    Family((_n("skipped_rows"),), "rows left out as faults: a non-finite gradient or input (a NaN, an fp16 "
           "overflow), a constant input row. 0 on a healthy run", "rows"),
    Family((_n("zero_grad_rows"),), "rows with a finite input and no gradient (exactly zero, or below 1e-5 "
           "of the call's rms `|w|`) because their position has no target: up to the rows where the final "
           "norm has no gradient either (a label of -100, a causal LM's last token), every row of a frozen "
           "norm's call. No share; said once", "rows"),
    Family((_n("vanished_grad_rows"),), "rows without gradient beyond those: rows whose position had a "
           "target (the final norm's row there has a gradient) and whose gradient vanished, a fault (a "
           "collapsing run; 0 on a healthy one), warned once; not logged where no final norm lines up with "
           "the norm's rows", "rows"),
    Family((ladder_metric("attenuation"),), "`inv_sigma(first rung) / inv_sigma(last rung)`", "ratio"),
    Family((ladder_metric("growth"),), "`rms(last rung) / rms(first rung)`", "ratio"),
    Family((ladder_metric("attenuation", "<stack>"), ladder_metric("growth", "<stack>")),
           "the same over another stack's ladder: an encoder-decoder's encoder (`<stack>` = "
           "`model.encoder`), each stack its own residual stream with its own final norm; the plain names "
           "are the stack of the norm before the logits (the decoder)", "ratio"),
    Family((_n("ladder_position"),), "the norm's place among the rungs in forward order (0 first; -1: not a "
           "rung; an encoder-decoder's encoder rungs, then its decoder's), logged at the first measured step "
           "of each fit (a resumed fit's too)", "index"),
    Family((run_metric("ladder"),), "(image) the ladder at this step: 1/sigma and rms of every rung against "
           "depth, the final norm marked (an encoder-decoder: the decoder's ladder); at measured steps at "
           "least `image_every_n_steps` (50) apart, and the last", "picture"),
    Family((run_metric("ladder_over_training"),), "(image) 1/sigma of every rung against depth and step, at "
           "the end of the fit", "picture"),
    Family((hist_metric("share", "<norm>"), hist_metric("sigma", "<norm>")), "(TensorBoard histogram) the "
           "measured step's shares and sigmas of the norm's rows", "0..1, input units"),
    Family((health_metric("<kind>"),), "1 while the finding `<kind>` holds, 0 after it ended (see "
           "[findings.md](findings.md)); logged only when it changes", "0 or 1"),
    Family((invariance_metric("dloss", "<case>"),), "loss with the final norm's input transformed minus the "
           "loss without (signed)", "nats"),
    Family((invariance_metric("log10_abs_dloss", "<case>"),), "`log10 |dloss|`, readable across the decades "
           "between the cases (absent when dloss is exactly 0)", "log10 nats"),
    Family((invariance_metric("max_dlogit", "<case>"),), "largest absolute change of a logit", "logit units"),
    Family((invariance_metric("out_residual", "<case>"),), "median `|xhat(Th) - xhat(h)| / |xhat(h)|` in "
           "float64 (for a scale a: exactly `|a sigma/sigma_a - 1|`): the clean geometric measure", "ratio"),
    Family((invariance_metric("scale_slope"), invariance_metric("scale_constant")),
           f"fit `|dloss| ~ constant * (eps/v)^slope` over the scale sweep a in {_SWEEP}: on the longest run "
           "of points with 1e-5 < eps/v < 10 whose delta-loss has one sign, and only when there are at least "
           "three (otherwise nothing is logged and the reason is kept in `last_result`); the sweep (7 passes "
           "more than the cases' 6, each replaying what ran before the final norm) runs at the end of the "
           "fit, after validations with `on_validation=True` and every `sweep_every_n_steps`", "-, nats"),
    Family((invariance_metric("scale_rounding_points"),), "sweep points with eps/v <= 1e-5 whose loss moved "
           "anyway: float32 rounding, not eps", "count"),
    Family(tuple(probe_metric(s, "<block>") for s in ("block_rank", "branch_rank")), "the structure probe: "
           "numerical rank of a residual block's Jacobian at one position, and of the branch through its "
           "first norm (float64, after validation)", "rank"),
    Family(tuple(probe_metric(s, "<block>") for s in ("block_sv_min", "block_sv_max", "branch_sv_min",
                                                       "branch_sv_max")),
           "the smallest and largest singular values of those Jacobians", "-"),
    Family((probe_metric("gain_spread", "<norm>"),), "largest over smallest nonzero singular value of "
           "`diag(g) (1/sigma) P`: how far the learned gain bends the norm's flat spectrum (1 without a "
           "gain)", "ratio"),
    Family(tuple(run_metric(s) for s in ("norm_kind", "eps", "width", "n_norms", "every_n_steps",
                                         "final_norm")),
           "(TensorBoard HPARAMS) the run's settings: the measured norms' kind, eps, width and count, the "
           "cadence, the final norm", "-"),
)
