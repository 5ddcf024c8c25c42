"""Findings: what the numbers mean for this run, said once, before the damage.

A :class:`Finding` states what was seen (one sentence with its number), what to try, and where in
docs/findings.md the testbed's figures are (:func:`long_form`).  :class:`FindingsReader` reads each measured
step's :class:`~lnmonitor.core.meter.meter.LadderResult` (nothing recomputed), every step's growth and the
training loss into a :class:`Reading`.  The growth is judged against the fit's first measured step (a ladder
tall there is said as information, never a finding).  Each kind is raised once per fit:
``warnings.warn(message, HealthWarning)`` and ``on_finding(finding)`` (returning True asks to stop the run).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lnmonitor.core.findings.evidence import EPS_COSTS, EPS_DELAYS, EPS_KNEE, TESTBED
from lnmonitor.core.findings.loss_rule import LadderSnapshot, LossRule, what_the_norms_did
from lnmonitor.core.findings.signals import crosses, growth_over_start, step_signals
from lnmonitor.core.monitor.arguments import ArgumentError, function
from lnmonitor.core.monitor.shared import warn_at_user
from lnmonitor.core.output.metric_names import health_metric, ladder_metric, parse
from lnmonitor.errors import HealthWarning

if TYPE_CHECKING:
    from lnmonitor.core.meter.meter import LadderMeter, LadderResult

__all__ = [
    "KINDS", "START_GROWTH", "TALL_AT_START", "Finding", "FindingKind", "FindingsReader", "Reading",
    "every_step", "finding_thresholds", "findings_reader", "health", "long_form", "reads_growth",
    "state_from_health", "state_from_log", "tall_start_message",
]

# the ladder's growth at a fit's start, kept in a framework's log for a resumed fit (state_from_log)
START_GROWTH = ladder_metric("growth")

# the signals the every-step growth watch feeds
GROWTH_SIGNALS = frozenset({"growth", "growth_over_start"})


@dataclass(frozen=True)
class FindingKind:
    """One kind of finding: the ``signal`` it reads, its ``direction`` (``">"``, ``"<"``) and default
    ``threshold``, and its English: ``seen`` (formatted with the step's figures), ``advice``, ``meant`` (the
    long form, formatted with :data:`~lnmonitor.core.findings.evidence.TESTBED`'s figures) and ``anchor``
    (its section of docs/findings.md)."""

    name: str
    signal: str
    direction: str
    threshold: float
    seen: str
    advice: str
    meant: str

    @property
    def anchor(self) -> str:
        return f"docs/findings.md#{self.name}"


# the growth at a fit's first measured step above which it is said as information (a pretrained
# checkpoint's ladder is tens to hundreds of times; healthy small models start near 1x)
TALL_AT_START = 20.0

KINDS: dict[str, FindingKind] = {k.name: k for k in (
    FindingKind(
        "stream_growth", "growth_over_start", ">", 35.0,
        "the residual stream grew {value:,.0f}x during this fit (the ladder, last rung's rms over the "
        "first's, went from {start:,.1f}x at the fit's first step to {growth:,.0f}x at step {step})",
        "lower the learning rate or add a warm-up",
        "on models and seeds its threshold was not fitted on (docs/findings.md), growth over the fit's start "
        "above 35x was said in time in {hits} of the {bad} runs that went wrong (the loss 0.3 behind the "
        "same run at a safe learning rate, or ending 0.1 behind), a median of {lead:g} steps ({lead_min} to "
        "{lead_max}) before the loss fell behind where it did, and on {false} of the {clean} runs that "
        "trained well: it leads where a run goes wrong from its first step or a tall checkpoint's fine-tune "
        "does; in a blow-up that begins mid-run it came after a plain loss rule (loss_blowup's); the final "
        "norm divides its gradient by this scale, so the layers before it learn at a rate you did not choose",
    ),
    FindingKind(
        "loss_blowup", "loss_over_minimum", ">", 1.5,
        "the loss rose to {loss:.4g} at step {step}, {value:.2f}x its lowest so far ({minimum:.4g}; the "
        "plain loss rule: above {threshold:g}x); what the norms did: {diagnosis}",
        "if the learning rate changed (a schedule, a restart), check it; lower it, or go back to the last "
        "checkpoint before the step",
        "a mid-run blow-up (a learning-rate bug, a burst of bad data, a collapsed Adam second moment) shows "
        "in the loss as early as in any norm signal measured: on the held-out mid-run testbed "
        "(docs/findings.md, \"Per kind of blow-up\") no norm signal led this rule, which fired in time (by "
        "the visible event, or within 20 steps of it) in {hits} of {events} blow-ups and on {false} of "
        "{healthy} healthy and {harmless} harmless runs; on runs from scratch it fired in {from_start_hits} "
        "of {from_start} that went wrong from their first step (stream_growth warns there) and on "
        "{from_start_false} of {from_start_clean} that trained well; so it claims no lead: it says when the "
        "loss went wrong and what the norms did then",
    ),
    FindingKind(
        "eps_dominates", "first_eps_over_var", ">", EPS_KNEE,
        "the first norm's eps is {value:,.0f}x the variance it reads (step {step}; the knee is "
        "{threshold:g}): it passes eps/(var+eps) of its gradient along its input instead of normalising",
        "lower eps, or start the stream the first norm reads at a variance well above eps (e.g. N(0, 1) "
        "embeddings instead of N(0, 0.02))",
        "at an eps/var of about 130, eps 0.1 cost validation loss against eps 1e-5 after 3,000 steps in "
        "every configuration measured (docs/eps.md): {eps_costs}; the size is the corpus's, so read it as a "
        "direction, not a figure for this run; in steps of training lost (the eps 1e-5 run reached the eps "
        "0.1 run's final loss that much earlier): {eps_delays}, so neither figure carries to another corpus "
        "or budget; in the stability testbed it fired in {hits} of the {bad} runs that went wrong, {lead:g} "
        "steps before the loss fell behind, and on {false} of the {clean} runs that trained well",
    ),
)}


@dataclass(frozen=True)
class Finding:
    """A finding of ``kind`` raised at ``step``: the ``value`` seen against the ``threshold``, and the
    ``message``."""

    kind: str
    step: int
    value: float
    threshold: float
    message: str


@dataclass
class Reading:
    """One step's findings: ``raised`` (new this fit), ``ended`` (kinds that held and no longer do),
    ``metrics`` (``lnmonitor/health/<kind>`` for every kind raised so far, 1 while it holds) and ``stop``
    (``on_finding`` returned True for one of them)."""

    raised: list[Finding] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    stop: bool = False


def _thresholds(value, name: str) -> dict[str, float]:
    """``None`` (the defaults) or a mapping from kinds to finite thresholds > 0 (``None``: off)."""
    defaults = {k: kind.threshold for k, kind in KINDS.items()}
    if value is None:
        return defaults
    if not isinstance(value, Mapping):
        raise ArgumentError(
            f"{name} must be None or a dict {{kind: threshold}} over {list(KINDS)}, got {value!r}")
    unknown = [k for k in value if k not in KINDS]
    if unknown:
        raise ArgumentError(f"{name} has unknown kind(s) {unknown}: the kinds are {list(KINDS)}")
    for kind, threshold in value.items():
        ok = threshold is None or (isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)
                                   and math.isfinite(threshold) and threshold > 0)
        if not ok:
            raise ArgumentError(f"{name}[{kind!r}] must be a finite number > 0, or None to turn it off, "
                                f"got {threshold!r}")
    return {**defaults, **{k: (None if v is None else float(v)) for k, v in value.items()}}


class FindingsReader:
    """Reads measured steps into findings (see the module docstring): ``thresholds`` override :data:`KINDS`'
    defaults (None turns a kind off); ``on_finding`` is called with each :class:`Finding` (an exception from
    it is said once and it is not called again); messages start with ``name`` and are said by
    ``warn(message)`` (default ``warnings.warn(message, HealthWarning)``) and ``info(message)``.  Raises
    :class:`ArgumentError` for a bad threshold or kind, or an ``on_finding`` that is not callable."""

    def __init__(self, *, thresholds: Mapping[str, float | None] | None = None,
                 on_finding: Callable[[Finding], object] | None = None, name: str = "lnmonitor",
                 warn: Callable[[str], None] | None = None,
                 info: Callable[[str], None] | None = None) -> None:
        self.thresholds = _thresholds(thresholds, "thresholds")
        self.on_finding = function(on_finding, "on_finding", "on_finding(finding)")
        self.name = name
        self._warn = warn or (lambda message: warn_at_user(message, HealthWarning))
        self._info = info or (lambda message: None)
        self.reset()

    def read(self, step: int, result: LadderResult | None) -> Reading:
        """The findings of measured step ``step`` (``result`` None: nothing said).  The fit's first measured
        step with a ladder sets the growth later steps are judged against."""
        if result is None:
            return Reading()
        signals = step_signals(result.figures)
        growth = signals["growth"]
        before, self.last = self.last, LadderSnapshot.of(step, result.figures)
        if self.start is None and math.isfinite(growth) and growth > 0:
            self.start, self.first = (step, growth), self.last
            if growth > TALL_AT_START:
                self._info(tall_start_message(self.name, step, growth))
        reading = self._judge(step, signals)
        if self.pending_loss is None:
            return reading
        said = self.say_pending_loss(before)
        return Reading(reading.raised + said.raised, reading.ended + said.ended, said.metrics,
                       reading.stop or said.stop)

    def read_growth(self, step: int, growth: float) -> Reading:
        """The every-step growth of step ``step``: only the growth's kinds are judged (nothing before the
        fit's first measured step)."""
        if self.start is None:
            return Reading()
        return self._judge(step, {"growth": growth})

    def read_loss(self, step: int, loss: float) -> Reading:
        """The training loss of step ``step``: only ``loss_blowup`` is judged.  When the rule first fires it
        is kept in :attr:`pending_loss`: the next :meth:`read` says it with what the norms did (or
        :meth:`say_pending_loss`, where nothing can be measured)."""
        minimum = self.loss_rule.minimum
        ratio = self.loss_rule.ratio(loss)
        if self.pending_loss is not None:
            return Reading()  # said with the measured step on its way
        signals = {"loss_over_minimum": ratio, "loss": loss, "loss_minimum": minimum}
        threshold = self.thresholds["loss_blowup"]
        if threshold is not None and "loss_blowup" not in self.raised and crosses(ratio, ">", threshold):
            self.pending_loss = (step, signals)
            return Reading()
        return self._judge(step, signals)

    def say_pending_loss(self, before: LadderSnapshot | None = None) -> Reading:
        """Say the loss rule's pending finding, with what the norms did between ``before`` (the measured step
        before it) and :attr:`last`."""
        if self.pending_loss is None:
            return Reading()
        (step, signals), self.pending_loss = self.pending_loss, None
        diagnosis = what_the_norms_did(self.first, before or self.last, self.last)
        return self._judge(step, signals, diagnosis)

    def _judge(self, step: int, signals: dict[str, float], diagnosis: str = "") -> Reading:
        """Raise, hold and end the kinds whose signal ``signals`` has (``diagnosis``: for the loss rule)."""
        reading = Reading()
        if self.start is not None:
            signals = {**signals, "growth_over_start": growth_over_start(signals.get("growth", math.nan),
                                                                         self.start[1])}
        for name, kind in KINDS.items():
            threshold = self.thresholds[name]
            value = signals.get(kind.signal, math.nan)
            if threshold is None or not math.isfinite(value):
                continue  # no figure this step: a held kind keeps its state
            holds = crosses(value, kind.direction, threshold)
            if holds and name not in self.raised:
                message = self._message(kind, step, value, threshold, signals, diagnosis)
                finding = Finding(name, step, value, threshold, message)
                self.raised[name] = finding
                reading.raised.append(finding)
            if name in self.holding and not holds:
                reading.ended.append(name)
            self.holding = (self.holding | {name}) if holds else (self.holding - {name})
        reading.metrics = {health_metric(k): float(k in self.holding) for k in self.raised}
        for finding in reading.raised:
            reading.stop = self._say_finding(finding) or reading.stop
        return reading

    def _message(self, kind: FindingKind, step: int, value: float, threshold: float,
                 signals: Mapping[str, float], diagnosis: str) -> str:
        start = self.start[1] if self.start is not None else math.nan
        seen = kind.seen.format(value=value, threshold=threshold, step=step, start=start,
                                growth=signals.get("growth", math.nan), loss=signals.get("loss", math.nan),
                                minimum=signals.get("loss_minimum", math.nan), diagnosis=diagnosis)
        return f"{self.name}: {seen}. Try: {kind.advice}. More: {kind.anchor}."

    def _say_finding(self, finding: Finding) -> bool:
        """Warn, and call ``on_finding``; True when it asks to stop the run."""
        self._warn(finding.message)
        if self.on_finding is None:
            return False
        try:
            return self.on_finding(finding) is True
        except Exception as err:  # noqa: BLE001 - the user's callable must not stop training
            self.on_finding = None
            self._warn(f"{self.name}: on_finding raised {type(err).__name__}: {err}; it is not called "
                       "again in this fit (training goes on). To stop the run from it, return True.")
            return False

    def reset(self) -> None:
        """A new fit: every kind may be raised again, against the new fit's first measured step."""
        self.raised: dict[str, Finding] = {}
        self.holding: set[str] = set()
        self.start: tuple[int, float] | None = None  # (step, growth) of the fit's first measured step
        self.first: LadderSnapshot | None = None  # the ladder at the fit's first measured step
        self.last: LadderSnapshot | None = None  # the ladder at the latest measured step
        self.loss_rule = LossRule()
        # the loss rule fired: (step, its signals), said with the next measured step's figures
        self.pending_loss: tuple[int, dict[str, float]] | None = None

    def state_dict(self) -> dict:
        """What a resumed fit needs not to raise a kind twice and to judge against the same start."""
        state = {"raised": {k: vars(f) for k, f in self.raised.items()}, "holding": sorted(self.holding),
                 "loss_rule": self.loss_rule.state_dict()}
        if self.start is not None:
            state["start"] = list(self.start)
        if self.first is not None:
            state["first"] = vars(self.first)
        return state

    def load_state_dict(self, state: Mapping) -> None:
        self.raised = {k: Finding(**f) for k, f in state.get("raised", {}).items()}
        self.holding = set(state.get("holding", ())) & set(self.raised)
        start = state.get("start")
        self.start = (int(start[0]), float(start[1])) if start else None
        self.first = LadderSnapshot(**state["first"]) if state.get("first") else None
        self.loss_rule.load_state_dict(state.get("loss_rule", {}))


def state_from_health(points: Iterable[tuple[int, str, float]],
                      start: tuple[int, float] | None = None) -> dict:
    """The :meth:`FindingsReader.state_dict` restored from a record of the ``lnmonitor/health/<kind>``
    values, ``points`` ``(step, kind, value)`` in step order, and the fit's ``start`` ``(step, growth)``: a
    kind with a value 1 is raised at the step of its first (value and threshold NaN, a note for message),
    and holds when its last value is 1; unknown kinds are left out."""
    raised: dict[str, dict] = {}
    last: dict[str, float] = {}
    for step, kind, value in points:
        if kind not in KINDS:
            continue
        if value == 1.0 and kind not in raised:
            note = f"{kind} was raised at step {step}, before the checkpoint this fit resumed from"
            raised[kind] = vars(Finding(kind, int(step), math.nan, math.nan, note))
        last[kind] = value
    state = {"raised": raised, "holding": sorted(k for k, v in last.items() if v == 1.0)}
    if start is not None:
        state["start"] = list(start)
    return state


def state_from_log(entries: Iterable[Mapping]) -> dict:
    """:func:`state_from_health` of a framework's log of dicts with a ``step`` (the Trainer's
    ``log_history``): its ``lnmonitor/health/<kind>`` values, and its first ``lnmonitor/ladder/growth`` as
    the fit's start."""
    points, start = [], None
    for entry in entries:
        if "step" not in entry:
            continue
        if START_GROWTH in entry and start is None:
            start = (entry["step"], entry[START_GROWTH])
        for tag, value in entry.items():
            metric = parse(tag)
            if metric is not None and metric.group == "health":
                points.append((entry["step"], metric.statistic, value))
    return state_from_health(points, start)


def findings_reader(findings, on_finding, speaks: Callable[[], bool], name: str,
                    info: Callable[[str], None] | None = None) -> FindingsReader | None:
    """The reader a monitor builds from its ``findings`` argument (see :func:`finding_thresholds`) and
    ``on_finding``, warning only where ``speaks()`` (rank zero); None for no findings.  Raises
    :class:`ArgumentError`."""
    thresholds = finding_thresholds(findings)
    if thresholds is None:
        function(on_finding, "on_finding", "on_finding(finding)")
        return None

    def warn(message: str) -> None:
        if speaks():
            warn_at_user(message, HealthWarning)

    return FindingsReader(thresholds=thresholds, on_finding=on_finding, name=name, warn=warn, info=info)


def finding_thresholds(findings) -> dict[str, float | None] | None:
    """A monitor's ``findings`` setting as ``{kind: threshold}`` (None or True: the defaults; a dict
    overrides them, None turning a kind off), or None for ``False``.  Raises :class:`ArgumentError`."""
    if findings is False:
        return None
    if findings is not None and findings is not True and not isinstance(findings, Mapping):
        raise ArgumentError(f"findings must be None or True (the default thresholds), False (no findings) "
                            f"or a dict {{kind: threshold}} over {list(KINDS)}, got {findings!r}")
    return _thresholds(None if findings is True else findings, "findings")


def health(reader: FindingsReader | None, step: int, result: LadderResult | None,
           stop: Callable[[], object]) -> dict[str, float]:
    """Read a measured step's findings, call ``stop()`` when ``on_finding`` asked to, and return the
    ``lnmonitor/health/<kind>`` metrics to log (empty without a reader)."""
    if reader is None:
        return {}
    reading = reader.read(step, result)
    if reading.stop:
        stop()
    return reading.metrics


def every_step(reader: FindingsReader | None, meter: LadderMeter | None, step: int,
               stop: Callable[[], object]) -> Reading:
    """At the end of every optimizer step: read the meter's every-step growth of ``step`` (on an accelerator
    said a step later); ``stop()`` when ``on_finding`` asked to stop."""
    if reader is None or meter is None:
        return Reading()
    taken = meter.take_growth(step)
    if taken is None:
        return Reading()
    reading = reader.read_growth(*taken)
    if reading.stop:
        stop()
    return reading


def reads_growth(reader: FindingsReader | None) -> bool:
    """Whether ``reader`` judges a kind read from the ladder's growth (the meter then watches every step)."""
    return reader is not None and any(
        kind.signal in GROWTH_SIGNALS and reader.thresholds[name] is not None for name, kind in KINDS.items())


def tall_start_message(name: str, step: int, growth: float) -> str:
    return (f"{name}: the ladder is already {growth:,.0f}x at the fit's first step ({step}, before any "
            "update): a fact of the model this fit starts from (a pretrained checkpoint's stream grows "
            "tens to hundreds of times over depth), not a finding; stream_growth judges the growth from "
            "here.")


def long_form(kind: str) -> str:
    """What a kind meant in the testbed, for the end-of-fit summary and docs."""
    costs = "; ".join(f"+{cost:.4f} nats/char with {where}" for where, cost in EPS_COSTS.items())
    delays = "; ".join(f"{median:,} of {budget:,} steps ({low:,} to {high:,}) with {where}"
                       for where, (budget, median, low, high) in EPS_DELAYS.items())
    return KINDS[kind].meant.format(eps_costs=costs, eps_delays=delays, **TESTBED[kind])
