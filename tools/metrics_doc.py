"""docs/metrics.md, the meaning and units of every name lnmonitor logs, written from :data:`FAMILIES`:
``python tools/metrics_doc.py [path]`` rewrites it (tests/test_metric_names.py checks that it is current
and that every name a fit logs belongs to a family)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, not an installed copy

from lnmonitor.core.output.metric_names import (  # noqa: E402
    INVARIANCE_CASES,
    baseline_metric,
    health_metric,
    hist_metric,
    invariance_metric,
    ladder_metric,
    per_norm,
    probe_metric,
    run_metric,
    unsplit,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


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


_HEAD = """\
# What each metric means

<!-- generated by `python tools/metrics_doc.py` from its
FAMILIES: edit those, then run it -->

`<norm>` is the module's qualified name (`model.blocks.0.ln1`, ..., `model.lnf`);
`v` is a row's variance (RMSNorm: its mean square); `w = gain * dL/dy` is the
vector that meets the norm's projector in the backward pass. Medians and
quantiles are over every row (token) of the measured step.

Under a `transformers.Trainer` its TensorBoard and W&B integrations put `train/` before
every name (`train/lnmonitor/sigma/<norm>`); the layout the Trainer callback writes and
`lnmonitor summarize` read them as the names here.

| metric | meaning | units |
|---|---|---|
"""

_TAIL = """
Cases: `shift_5`, `shift_1000` (h + c·1), `scale_3`, `scale_3_shift_5`, and the
control `axis_5` (+5 on one coordinate, which must move the loss). The transform
is applied in float64 in a hook on the final norm, so for a LayerNorm both shifts
give exactly 0 and the scales show the eps effect alone. The probe rows are one
definition shared by the monitor, `analyze` and `eps-compare`: the first 64
held-out windows (`probe_size`). Quantiles come from fixed-bin histograms over
the whole float32 range (from the float's bits, nothing clamped): share to
2.4e-4, sigma / 1/sigma / rms to 0.39%, eps/var and transmission to 0.78%; the
share maximum is exact.
"""


def _names(names: tuple[str, ...]) -> str:
    """The first name in full, the others without the shared ``lnmonitor/``."""
    first, *rest = names
    return ", ".join([f"`{first}`", *(f"`{n.removeprefix('lnmonitor/')}`" for n in rest)])


def render() -> str:
    """The text of docs/metrics.md."""
    rows = [f"| {_names(f.names)} | {f.meaning.replace('|', chr(92) + '|')} | {f.units} |" for f in FAMILIES]
    return _HEAD + "\n".join(rows) + "\n" + _TAIL


def main(argv: list[str] | None = None) -> None:
    """Write :func:`render` to ``argv[0]`` (default docs/metrics.md)."""
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else DOC
    path.write_text(render(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
