"""The one definition of every figure lnmonitor reports about a step's norms.

The meter (:mod:`lnmonitor.core.meter.meter`), on a training step or on the held-out batches of
``analyze`` and ``eps-compare`` (:mod:`lnmonitor.core.meter.heldout`), hands over each norm's
:class:`~lnmonitor.core.meter.row_stats.RowStats` (quantiles over rows) with its name, kind,
width and the eps it applied; :func:`norm_figures` and :func:`ladder_figures` turn them into
the figures: sigma, 1/sigma, rms, eps/var, the transmission
(:func:`lnmonitor.core.maths.geometry.transmission`), the dead-plane shares against the exact random
baseline, and
the ladder's attenuation and growth over its rungs (one ladder per residual stream: an
encoder-decoder's encoder has its own, :class:`Ladder`).  :meth:`LadderFigures.metrics` names
them as logged (docs/design.md, :mod:`lnmonitor.core.output.metric_names`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from lnmonitor.core.kinds import NormKind
from lnmonitor.core.maths import geometry, random_baseline
from lnmonitor.core.output.metric_names import baseline_metric, ladder_metric, per_norm

if TYPE_CHECKING:
    from lnmonitor.core.meter.row_stats import RowStats

__all__ = [
    "Ladder", "LadderFigures", "NormFigures", "baseline_max", "baseline_median", "ladder_figures",
    "norm_figures",
]


@dataclass(frozen=True)
class NormFigures:
    """The figures of one norm in one step: ``sigma = sqrt(var + eps)`` (input units), ``inv_sigma
    = 1 / sigma`` (the ladder), ``rms = sqrt(ms)``, ``eps_over_var = eps / var`` and the
    ``transmission = eps / (var + eps)`` (dimensionless), where ``var`` is the median over rows of
    the norm's input variance (mean square for RMSNorm) and ``ms`` the median of the stream's mean
    square ``mean(x^2)``; ``eps`` is the one the norm applied; ``stats`` holds the rest of what
    was measured (the dead-plane shares' quantiles and the rows counted, nan or 0 where nothing
    was)."""

    name: str
    kind: NormKind
    width: int | None
    eps: float
    stats: RowStats
    sigma: float
    inv_sigma: float
    rms: float
    eps_over_var: float
    transmission: float


@dataclass(frozen=True)
class Ladder:
    """The ladder of one stack other than the model's (an encoder-decoder's encoder):
    ``stack``, the qualified name of the module that holds it, and its rungs, final norm,
    attenuation and growth as in :class:`LadderFigures`."""

    stack: str
    rungs: list[str]
    final: str | None
    attenuation: float
    growth: float


@dataclass(frozen=True)
class LadderFigures:
    """Every norm's figures (in the order given), the ladder's rungs (forward order, the
    final norm last when there is one), ``attenuation = inv_sigma(first rung) /
    inv_sigma(last rung)`` and ``growth = rms(last rung) / rms(first rung)`` (nan with fewer
    than two rungs), and the random-direction baselines of the shares.  The ladder is the
    model's (the stack of the norm before the logits); ``other_ladders`` holds the ladders of the
    other stacks, each its own residual stream (an encoder-decoder's encoder), in forward order."""

    norms: list[NormFigures]
    rungs: list[str]
    final: str | None
    attenuation: float
    growth: float
    baselines: dict[str, float]
    other_ladders: tuple[Ladder, ...] = ()

    def by_name(self) -> dict[str, NormFigures]:
        return {f.name: f for f in self.norms}

    def baseline(self, name: str) -> tuple[float, float]:
        """``(median, max)``: the random-direction baselines norm ``name``'s median and max
        share are compared with (the shared pair, or the norm's own; nan where there is none)."""
        pair = []
        for which in ("median", "max"):
            shared = self.baselines.get(baseline_metric(which), math.nan)
            pair.append(self.baselines.get(baseline_metric(which, name), shared))
        return pair[0], pair[1]

    @property
    def main(self) -> Ladder:
        """The model's ladder as a :class:`Ladder` (its ``stack`` is ``""``)."""
        return Ladder("", self.rungs, self.final, self.attenuation, self.growth)

    def metrics(self) -> dict[str, float]:
        """The figures under their logged names (nan entries included: the caller drops
        what is not finite)."""
        m: dict[str, float] = {}
        for f in self.norms:
            s, n = f.stats, f.name
            positive = s.var_median > 0 and f.eps > 0
            m[per_norm("sigma", n)] = f.sigma
            m[per_norm("inv_sigma", n)] = f.inv_sigma
            m[per_norm("rms", n)] = f.rms
            m[per_norm("eps_over_var", n)] = f.eps_over_var
            m[per_norm("transmission", n)] = f.transmission
            # the same on a log scale, readable where the values span decades
            m[per_norm("log10_eps_over_var", n)] = math.log10(f.eps_over_var) if positive else math.nan
            m[per_norm("log10_transmission", n)] = math.log10(f.transmission) if positive else math.nan
            m[per_norm("share_median", n)] = s.share_median
            m[per_norm("share_p90", n)] = s.share_p90
            m[per_norm("share_max", n)] = s.share_max
            m[per_norm("skipped_rows", n)] = float(s.skipped_rows)
            m[per_norm("zero_grad_rows", n)] = float(s.zero_grad_rows)
            m[per_norm("vanished_grad_rows", n)] = s.vanished_grad_rows
        m.update(self.baselines)
        for ladder in (self.main, *self.other_ladders):
            if len(ladder.rungs) >= 2:
                m[ladder_metric("attenuation", ladder.stack)] = ladder.attenuation
                m[ladder_metric("growth", ladder.stack)] = ladder.growth
        return m

    def positions(self) -> dict[str, float]:
        """``lnmonitor/ladder_position/<norm>``: each rung's place in forward order (0 first),
        -1 for the norms that are not rungs; the other stacks' rungs come first (an
        encoder-decoder's encoder, then its decoder)."""
        rungs = [name for ladder in (*self.other_ladders, self) for name in ladder.rungs]
        place = {name: float(i) for i, name in enumerate(rungs)}
        return {per_norm("ladder_position", f.name): place.get(f.name, -1.0) for f in self.norms}


def norm_figures(name: str, kind: NormKind, width: int | None, eps: float, stats: RowStats) -> NormFigures:
    """The figures of norm ``name`` (of ``kind`` and ``width``, applying ``eps``) from its
    statistics."""
    var, ms = stats.var_median, stats.ms_median
    sigma = math.sqrt(var + eps) if var + eps >= 0 else math.nan
    return NormFigures(
        name=name, kind=kind, width=width, eps=eps, stats=stats,
        sigma=sigma,
        inv_sigma=1.0 / sigma if sigma > 0 else math.nan,
        rms=math.sqrt(ms) if ms >= 0 else math.nan,
        eps_over_var=eps / var if var > 0 else math.nan,
        transmission=geometry.transmission(var, eps) if var + eps > 0 else math.nan,
    )


def ladder_figures(
    figures: Sequence[NormFigures], rungs: Sequence[str], final: str | None = None,
    other_ladders: Mapping[str, tuple[Sequence[str], str | None]] | None = None,
) -> LadderFigures:
    """The ladder of the norms' ``figures`` (:func:`norm_figures`); ``rungs`` names the norms that
    read the residual stream in forward order (``final``, when given, ends the ladder wherever it
    stands in ``rungs``).  ``other_ladders`` gives the other stacks' ladders the same way,
    ``{stack: (rungs, final)}`` in forward order (an encoder-decoder's encoder; ``rungs`` and
    ``final`` are then the decoder's).  A rung not measured this step has nan figures, and so have
    the attenuation and growth then: they are never taken between other rungs than the ladder's
    ends."""
    figures = list(figures)
    by_name = {f.name: f for f in figures}
    main = _ladder(by_name, "", rungs, final)
    others = tuple(_ladder(by_name, stack, r, f) for stack, (r, f) in (other_ladders or {}).items())
    return LadderFigures(figures, main.rungs, main.final, main.attenuation, main.growth,
                         _baselines(figures), others)


def _ladder(by_name: Mapping[str, NormFigures], stack: str, rungs: Sequence[str],
            final: str | None) -> Ladder:
    ladder = [n for n in rungs if n in by_name]
    if final in ladder:
        ladder = [n for n in ladder if n != final] + [final]
    attenuation = growth = math.nan
    if len(ladder) >= 2:
        first, last = by_name[ladder[0]], by_name[ladder[-1]]
        attenuation = first.inv_sigma / last.inv_sigma
        growth = last.rms / first.rms if first.rms > 0 else math.nan
    return Ladder(stack, ladder, final if final in ladder else None, attenuation, growth)


def _baselines(figures: Sequence[NormFigures]) -> dict[str, float]:
    """One pair of baselines when every norm has one width and dead-subspace dimension,
    else one pair per norm (``.../median/<norm>``, ``.../max/<norm>``)."""
    shapes = {(f.width, geometry.dead_dim(f.kind)) for f in figures}
    out: dict[str, float] = {}
    if len(shapes) == 1:
        d, k = next(iter(shapes))
        if d is None or d <= k:
            return out
        out[baseline_metric("median")] = baseline_median(d, k)
        n = max(f.stats.share_rows for f in figures)
        if n >= 1:
            out[baseline_metric("max")] = baseline_max(d, k, n)
        return out
    for f in figures:
        k = geometry.dead_dim(f.kind)
        if f.width is None or f.width <= k:
            continue
        out[baseline_metric("median", f.name)] = baseline_median(f.width, k)
        if f.stats.share_rows >= 1:
            out[baseline_metric("max", f.name)] = baseline_max(f.width, k, f.stats.share_rows)
    return out


@lru_cache(maxsize=256)
def baseline_median(d: int, k: int) -> float:
    """Median dead-plane share of a random direction in ``d`` dimensions, ``k``-dim dead subspace."""
    return float(random_baseline.share_median(d, k))


@lru_cache(maxsize=4096)
def baseline_max(d: int, k: int, n: int) -> float:
    """Median of the maximum share of ``n`` random directions (compare with a measured max)."""
    return float(random_baseline.max_share_median(d, k, n))
