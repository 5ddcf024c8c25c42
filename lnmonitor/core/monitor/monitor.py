"""The one object every monitor drives: :class:`Monitor`, a run of the meter from its
:class:`~lnmonitor.core.monitor.settings.Settings`.

A framework's callback (Lightning's, the ``transformers.Trainer``'s, the plain loop's) only maps
its events to these calls and hands over how its framework logs; everything else is here once:

* :meth:`Monitor.begin` -- a run begins on a model: the meter, the findings, the pictures;
* :meth:`Monitor.start` -- a step begins: the cadence (every ``every_n_steps``-th step, the
  run's first and last, and a step the loss rule asked for) hooks the norms;
* :meth:`Monitor.add_loss`, :meth:`Monitor.use_batch` -- what a micro-batch hands over;
* :meth:`Monitor.end_step` -- a step ended: the post-step sequence
  (:class:`~lnmonitor.core.monitor.after_step.AfterStep`: findings, metrics, log, pictures);
* :meth:`Monitor.end` -- the run ended: the ladder over training and the summary;
* :meth:`Monitor.state_dict`, :meth:`Monitor.load_state_dict` -- what a resumed run needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lnmonitor.core.findings.reader import findings_reader, reads_growth
from lnmonitor.core.invariance.results import InvarianceResult
from lnmonitor.core.invariance.runs import InvarianceRuns
from lnmonitor.core.meter.meter import LadderMeter, LadderResult
from lnmonitor.core.monitor.after_step import AfterStep, Log
from lnmonitor.core.monitor.settings import Settings
from lnmonitor.core.monitor.shared import History
from lnmonitor.core.wrappers import model_class

if TYPE_CHECKING:
    from torch import nn

    from lnmonitor.core.monitor.shared import Messages

__all__ = ["Monitor", "MonitorAttributes"]

LOOP_EVERY_N_STEPS = 50  # the cadence of a framework with no log cadence of its own (a plain loop)


class Monitor:
    """A monitor's runs, from its ``settings``.

    Args:
        settings: the monitor's :class:`~lnmonitor.core.monitor.settings.Settings`.
        name: the name its messages start with.
        messages: how it speaks (:class:`~lnmonitor.core.monitor.shared.Messages`).
        views: ``views(name, info, warn, images=, image_every_n_steps=, summary=)``: the run's
            pictures and summary (:class:`lnmonitor.views.run_views.RunViews`; core draws nothing).
        first_step: the number the framework gives a run's first step (it is measured whatever
            the cadence: the start the findings judge growth from).
        advice: what the invariance probe's message adds when its default loss failed.

    Attributes:
        history: the logged dicts, kept where nothing else receives them (``keep_history``).
        runs: the invariance probe's runs (:class:`~lnmonitor.core.invariance.runs.InvarianceRuns`).
    """

    def __init__(self, settings: Settings, name: str, messages: Messages, views: Callable, *,
                 first_step: int = 0, advice: str = "") -> None:
        self.settings, self.name, self.messages, self._views = settings, name, messages, views
        self.history = History(settings.keep_history)
        self.runs = InvarianceRuns(name, messages, advice=advice)
        self.findings = findings_reader(settings.findings, settings.on_finding, lambda: messages.speaks,
                                        name, messages.info)
        self.first_step = first_step
        self.every_n_steps = settings.every_n_steps
        self.meter: LadderMeter | None = None
        self.after: AfterStep | None = None
        self.last_step: int | None = None
        self.logged = -1  # the last step whose ladder metrics or findings were logged
        self.measuring: int | None = None
        self.order: list[str] = []  # a resumed run's forward order, until the meter has its own
        self._resumed_every: int | None = None  # a resumed run's cadence
        self._log: Log | None = None

    def reset(self) -> None:
        """A new run (a resumed one loads its state after this): nothing logged, no finding raised."""
        self.close()
        self.logged, self.order, self._resumed_every = -1, [], None
        if self.findings is not None:
            self.findings.reset()

    @property
    def last_result(self) -> LadderResult | None:
        """The last measured step's result."""
        return self.after.last_result if self.after is not None else None

    def begin(self, model: nn.Module, log: Log, *, speaks: Callable[[], bool],
              every_n_steps: int | None = None, last_step: int | None = None) -> LadderMeter:
        """A run begins on ``model``: its meter, findings and pictures; ``log(step, metrics, result)``
        is the framework's logging (True when this process logged), ``every_n_steps`` the
        framework's log cadence (used when the settings have none), ``last_step`` the run's last
        step when known.  Raises what the meter refuses (a model with no norm to measure)."""
        s = self.settings
        self.close()
        self.meter = LadderMeter(model, include=s.include, exclude=s.exclude, final_norm=s.final_norm,
                                 ladder=s.ladder, row_mask=s.row_mask, name=self.name,
                                 info=self.messages.info, warn=self.messages.warn,
                                 watch_growth=reads_growth(self.findings))
        self.meter.order = list(self.order)
        views = self._views(self.name, self.messages.info, self.messages.warn, images=s.images,
                            image_every_n_steps=s.image_every_n_steps, summary=s.summary)
        self.after = AfterStep(self.meter, self.findings, views, speaks=speaks, warn=self.messages.warn,
                               name=self.name)
        self.every_n_steps = s.every_n_steps or self._resumed_every or every_n_steps or LOOP_EVERY_N_STEPS
        self.last_step, self._log, self.measuring = last_step, log, None
        return self.meter

    def due(self, step: int) -> bool:
        """Whether step ``step`` is measured by the cadence: the run's first, every
        ``every_n_steps``-th and the last."""
        return step == self.first_step or step % self.every_n_steps == 0 or step == self.last_step

    def start(self, step: int) -> bool:
        """Step ``step`` begins: hook the norms when it is due (or the loss rule asked for it) and
        not logged already (a resumed run's); True when it is measured."""
        if self.meter is None or self.meter.off_reason or self.measuring is not None or step <= self.logged:
            return False
        if not (self.due(step) or self.after.wants_measurement):
            return False
        self.measuring = step
        self.meter.start()
        return True

    def use_batch(self, batch) -> None:
        """A micro-batch of the measured step: its padding is left out of the rows."""
        if self.measuring is not None:
            self.meter.use_batch(batch)

    def add_loss(self, loss) -> None:
        """A micro-batch's training loss, for the loss rule (``loss_blowup``)."""
        if self.after is not None:
            self.after.add_loss(loss)

    def end_step(self, step: int, stop: Callable[[], object], *, judge_loss: bool = True,
                 write_image=None, counts: bool = False, label: str | None = None) -> dict[str, float] | None:
        """Optimizer step ``step`` ended (every process calls this together): the findings' every-step
        growth and, with ``judge_loss``, the loss handed over; then, when the step was measured,
        its metrics, logged.  ``stop()``: a finding asked the run to stop.  Returns the measured
        step's metrics (None: not measured)."""
        measured, self.measuring = self.measuring, None
        self.after.every_step(step, self.log, stop, measured=measured is not None)
        if judge_loss:
            self.after.loss(step, self.log, stop)
        if measured is None:
            return None
        return self.after.measured(step, self.log, stop, counts=counts, label=label, write_image=write_image,
                                   last=step == self.last_step)

    def judge_loss(self, step: int, stop: Callable[[], object]) -> None:
        """The losses handed over since the last call, judged at ``step`` (a framework that logs its
        loss apart from its steps: the same on every process)."""
        self.after.loss(step, self.log, stop, across=False)

    def log(self, step: int, metrics: dict[str, float], result: LadderResult | None = None) -> bool:
        """``metrics`` of ``step`` through the framework's logging; True when this process logged."""
        logged = self._log(step, metrics, result)
        if logged:
            self.logged = max(self.logged, step)
        return logged

    def end(self, write_image=None) -> None:
        """The run ended: the ladder over training (a picture, through ``write_image``) and the
        summary, with the settings that differ from the defaults."""
        self.close()
        if self.after is not None:
            title = f"{model_class(self.meter.model)}, end of training"
            self.after.end(write_image, title, self.settings.changed())

    def close(self) -> None:
        """No hook left and no step in progress (an exception, the end of a run)."""
        self.measuring = None
        if self.meter is not None:
            self.meter.close()

    def state_dict(self) -> dict:
        """What a resumed run needs: the cadence it measured at, the last step it logged, the
        norms' forward order, and which findings it raised (no kind is raised twice)."""
        order = self.meter.order if self.meter is not None and self.meter.order else self.order
        state = {"every_n_steps": self.every_n_steps, "last_logged_step": self.logged, "order": list(order)}
        if self.findings is not None:
            state["findings"] = self.findings.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (a missing entry: as a fresh run)."""
        if self.findings is not None and "findings" in state:
            self.findings.load_state_dict(state["findings"])
        if self.settings.every_n_steps is None and state.get("every_n_steps"):
            self._resumed_every = self.every_n_steps = int(state["every_n_steps"])
        self.logged = int(state.get("last_logged_step", -1))
        self.order = list(state.get("order", []))
        if self.meter is not None:
            self.meter.order = list(self.order)


class MonitorAttributes:
    """What a user reads of a callback built on a :class:`Monitor` (``self.monitor``)."""

    monitor: Monitor

    @property
    def last_result(self) -> LadderResult | None:
        """The last measured step's result."""
        return self.monitor.last_result

    @property
    def last_invariance(self) -> InvarianceResult | None:
        """The last probe run's full result (its sweep points included)."""
        return self.monitor.runs.last

    @property
    def invariance_off_reason(self) -> str | None:
        """Why the invariance probe is off for this run (None while it is on, or never asked for)."""
        return self.monitor.runs.off_reason

    @property
    def history(self) -> list[dict[str, float]]:
        """Every logged dict, with its ``step`` (see ``keep_history``)."""
        return self.monitor.history.rows

    def detach(self) -> None:
        """Remove every hook and forget the step in progress (the guard tripped, or the run ended)."""
        self.monitor.close()
