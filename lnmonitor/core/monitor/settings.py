"""The one configuration every monitor takes: :class:`Settings`, checked where it is built.

Every monitor accepts one ``Settings`` as ``settings=``, or keyword arguments of the same names, so a
setting has one name, default, check and meaning everywhere; what only one framework has (the loop's
``writer``, Lightning's ``histograms``, the probe's ``probe_batch``) stays an argument of that monitor::

    >>> Settings(every_n_steps=10, invariance_every_n_steps=500).changed()
    {'every_n_steps': 10, 'invariance_every_n_steps': 500}
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
    """What a monitor measures, when, and what it shows.  Raises
    :class:`~lnmonitor.core.monitor.arguments.ArgumentError` naming the setting and what to pass (the
    Lightning callbacks raise it as Lightning's ``MisconfigurationException``, same message)."""

    every_n_steps: int | None = None
    """Measure every this many optimizer steps (and the last one when known); None: the framework's log
    cadence (``log_every_n_steps``, ``logging_steps``; a plain loop: 50)."""

    include: str | Sequence[str] | None = None
    """``fnmatch`` glob(s) over the norms' qualified names: only these are measured (None: all)."""

    exclude: str | Sequence[str] | None = None
    """Glob(s) of norms left out (after ``include``)."""

    final_norm: str | None = None
    """Qualified name of the final norm (the invariance probe checks it); None: found on the first
    measured step."""

    ladder: str | Sequence[str] | None = None
    """Glob(s) naming the ladder's rungs (the residual-stream norms); None: found from the gradient."""

    row_mask: Callable | bool | None = None
    """``row_mask(batch)`` -> bool tensor of the rows (tokens) to measure; None: the batch's padding
    (``attention_mask`` 0) is left out; False: every row counts."""

    findings: Mapping[str, float | None] | bool | None = None
    """The findings (docs/findings.md): None or True for the default thresholds, ``{kind: threshold}``
    (None turns a kind off), False for none."""

    on_finding: Callable | None = None
    """Called with each :class:`~lnmonitor.core.findings.reader.Finding` once per kind per fit; True
    stops the run."""

    invariance_every_n_steps: int | None = 1000
    """Run the invariance probe every this many optimizer steps and at the end (with its scale sweep);
    None: no probe (``FinalNormInvarianceMonitor``: after validations, with ``on_validation=True``)."""

    probe_size: int | None = PROBE_WINDOWS
    """The invariance probe's rows: the first this many held-out samples; None: one whole batch."""

    cases: Sequence[str] = CASES
    """The invariance cases, a subset of ``shift_5, shift_1000, scale_3, scale_3_shift_5, axis_5``."""

    scales: Sequence[float] = SWEEP_SCALES
    """The scale sweep's scales; an empty tuple skips the sweep."""

    images: bool = True
    """Log the ladder's picture on measured steps, and the ladder over training at the end."""

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
        """``settings``, or one built from keyword ``fields`` (not both); a field that is not a setting,
        or not one the monitor ``reads`` (None: all), is refused with the names it takes."""
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
        """The settings that differ from their defaults, in field order."""
        default = Settings()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}
