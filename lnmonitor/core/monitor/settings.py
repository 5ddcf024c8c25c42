"""The one configuration every monitor takes: :class:`Settings`, one name per setting, checked
where it is built.

Every monitor (:class:`~lnmonitor.LayerNormMonitor`, :class:`~lnmonitor.FinalNormInvarianceMonitor`,
:class:`~lnmonitor.LNMonitorCallback`, :class:`~lnmonitor.LoopMonitor`) accepts one
``Settings`` as ``settings=``, or builds one from keyword arguments of the same names, so a
setting has the same name, default, check and meaning everywhere.  What only one framework has
(the loop's ``writer`` and ``max_steps``, Lightning's ``histograms``, the probe's own
``probe_batch`` and ``loss_fn``) stays an argument of that monitor.

Example::

    >>> from lnmonitor import Settings
    >>> settings = Settings(every_n_steps=10, invariance_every_n_steps=500)
    >>> settings.changed()
    {'every_n_steps': 10, 'invariance_every_n_steps': 500}
    >>> Settings(every_n_steps=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lnmonitor.core.monitor.arguments.ArgumentError: every_n_steps must be a positive integer ...
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lnmonitor.core.findings.reader import finding_thresholds
from lnmonitor.core.invariance.results import CASES, PROBE_WINDOWS, SWEEP_SCALES
from lnmonitor.core.monitor import arguments

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """What a monitor measures, when, and what it shows; checked when built
    (:class:`~lnmonitor.core.monitor.arguments.ArgumentError` names the setting and what to pass;
    the Lightning callbacks raise it as ``MisconfigurationException``)."""

    every_n_steps: int | None = None
    """Measure the norms every this many optimizer steps, counted from the fit's first, and the
    last step when it is known; None: the framework's log cadence (Lightning's
    ``log_every_n_steps``, the Trainer's ``logging_steps``; a plain loop: 50)."""

    include: str | Sequence[str] | None = None
    """``fnmatch`` glob(s) over the norms' qualified names: only these are measured (None: all)."""

    exclude: str | Sequence[str] | None = None
    """Glob(s) of norms left out (after ``include``)."""

    final_norm: str | None = None
    """Qualified name of the final norm; None: found on the first measured step (the last norm
    to run whose input reaches the loss through it alone).  The invariance probe checks it."""

    ladder: str | Sequence[str] | None = None
    """Glob(s) naming the ladder's rungs (the norms that read the residual stream); None: found
    from the gradient on the first measured step."""

    row_mask: Callable | bool | None = None
    """``row_mask(batch)`` -> bool tensor, True on the rows (tokens) to measure; None: the
    batch's padding (``attention_mask`` 0) is left out; False: every row counts."""

    findings: Mapping[str, float | None] | bool | None = None
    """The findings read from the measured steps (docs/findings.md): None or True for the
    default thresholds, a dict ``{kind: threshold}`` (None turns a kind off), False for none."""

    on_finding: Callable | None = None
    """Called with each :class:`~lnmonitor.core.findings.reader.Finding` once per kind per fit;
    returning True stops the run."""

    invariance_every_n_steps: int | None = 1000
    """Run the final-norm invariance probe every this many optimizer steps and at the end of
    training (with its scale sweep); None: no probe (``FinalNormInvarianceMonitor``: after
    validations only, with ``on_validation=True``)."""

    probe_size: int | None = PROBE_WINDOWS
    """The invariance probe's rows: the first this many held-out samples; None: one whole batch."""

    cases: Sequence[str] = CASES
    """The invariance cases to run, a subset of ``shift_5, shift_1000, scale_3, scale_3_shift_5,
    axis_5``."""

    scales: Sequence[float] = SWEEP_SCALES
    """The scale sweep's scales; an empty tuple skips the sweep."""

    images: bool = True
    """Log the ladder's picture on measured steps and the ladder over training at the end."""

    image_every_n_steps: int = 50
    """The least number of steps between two ladder pictures (the last step gets one)."""

    summary: bool = True
    """Print the one-screen summary at the end of training (rank zero)."""

    keep_history: bool | None = None
    """Keep every logged dict in ``.history``; None: only where nothing else receives them."""

    def __post_init__(self) -> None:
        checked = {
            "every_n_steps": arguments.positive_int(self.every_n_steps, "every_n_steps"),
            "include": arguments.patterns(self.include, "include"),
            "exclude": arguments.patterns(self.exclude, "exclude"),
            "final_norm": arguments.module_name(self.final_norm, "final_norm", "transformer.ln_f"),
            "ladder": arguments.patterns(self.ladder, "ladder"),
            "row_mask": arguments.row_mask(self.row_mask),
            "on_finding": arguments.function(self.on_finding, "on_finding", "on_finding(finding)"),
            "invariance_every_n_steps": arguments.positive_int(self.invariance_every_n_steps,
                                                               "invariance_every_n_steps"),
            "probe_size": arguments.positive_int(self.probe_size, "probe_size", unit="samples"),
            "cases": arguments.choices(self.cases, "cases", CASES),
            "scales": arguments.scales(self.scales, "scales"),
            "images": arguments.flag(self.images, "images"),
            "image_every_n_steps": arguments.positive_int(self.image_every_n_steps, "image_every_n_steps",
                                                          allow_none=False),
            "summary": arguments.flag(self.summary, "summary"),
            "keep_history": arguments.optional_flag(self.keep_history, "keep_history"),
        }
        finding_thresholds(self.findings)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def build(cls, settings: Settings | None, fields: Mapping[str, object], name: str,
              reads: Sequence[str] | None = None) -> Settings:
        """A monitor's settings: ``settings`` (a :class:`Settings`), or keyword ``fields`` of the
        same names (not both); a name that is not a setting, or not one of those the monitor
        ``reads`` (None: all), is refused with the names it takes."""
        names = [f.name for f in dataclasses.fields(cls)] if reads is None else list(reads)
        unknown = [key for key in fields if key not in names]
        if unknown:
            near = [close[0] for key in unknown if (close := difflib.get_close_matches(key, names, 1))]
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise arguments.ArgumentError(
                f"{name} has no setting {', '.join(map(repr, unknown))}{hint} It takes {names} "
                "(lnmonitor.Settings)")
        if settings is None:
            return cls(**fields)
        if not isinstance(settings, cls) or fields:
            raise arguments.ArgumentError(
                f"{name} takes settings=lnmonitor.Settings(...) or the settings as keyword arguments, "
                f"not both; got settings={settings!r} and {sorted(fields)}")
        return settings

    def changed(self) -> dict[str, object]:
        """The settings that differ from their defaults, in field order (for the summary's header)."""
        default = Settings()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}
