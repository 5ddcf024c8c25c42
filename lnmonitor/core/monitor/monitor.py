"""The one object every monitor drives: :class:`Monitor`, a run of the meter from its
:class:`~lnmonitor.core.monitor.settings.Settings`.

A framework's callback (Lightning's, the ``transformers.Trainer``'s, the plain loop's) only maps
its events to these calls and hands over how its framework logs; everything else is here once:

* :meth:`Monitor.begin` -- a run begins on a model: the meter, the findings, the pictures;
* :meth:`Monitor.start` -- a step begins: the cadence (every ``every_n_steps``-th step, the
  run's first and last, and a step the loss rule asked for) hooks the norms;
* :meth:`Monitor.add_loss`, :meth:`Monitor.use_batch` -- what a micro-batch hands over;
* :meth:`Monitor.end_step` -- a step ended: the every-step growth and the loss to the findings
  (a kind raised or ended is logged at once), and a measured step's metrics with its findings,
  logged, kept for the summary, and the ladder's picture;
* :meth:`Monitor.probe` -- the invariance probe's run at a step, logged;
* :meth:`Monitor.end` -- the run ended: the ladder over training and the summary;
* :meth:`Monitor.state_dict`, :meth:`Monitor.load_state_dict` -- what a resumed run needs.

The pictures and summary (:class:`lnmonitor.views.run_views.RunViews`) come from the callback:
this level draws nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from lnmonitor.core.findings.reader import every_step, findings_reader, health, reads_growth
from lnmonitor.core.invariance.results import InvarianceResult
from lnmonitor.core.invariance.runs import InvarianceRuns
from lnmonitor.core.meter.meter import LadderMeter, LadderResult
from lnmonitor.core.meter.processes import StepMaximum, several_processes
from lnmonitor.core.monitor.settings import Settings
from lnmonitor.core.monitor.shared import History
from lnmonitor.core.wrappers import model_class

if TYPE_CHECKING:
    from torch import nn

    from lnmonitor.core.monitor.shared import Messages

__all__ = ["Log", "Monitor", "MonitorAttributes"]

LOOP_EVERY_N_STEPS = 50  # the cadence of a framework with no log cadence of its own (a plain loop)

Log = Callable[[int, dict, "LadderResult | None"], bool]
"""``log(step, metrics, result)``: the framework logs ``metrics`` at ``step`` (``result``: the
measured step's, None otherwise); True when this process logged them."""


class Views(Protocol):
    def add(self, step: int, metrics: dict[str, float]) -> None: ...
    def step(self, write, result, step: int, last: bool = False) -> None: ...
    def end(self, write, title: str, watched: Sequence[str] | None = None,
            start: tuple[int, float] | None = None, settings: Mapping[str, object] | None = None) -> None: ...


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
        positions: whether each norm's ladder position still goes with the next logged measured
            step (it goes with the first one of a run).
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
        self.views: Views | None = None
        self.last_step: int | None = None
        self.logged = -1  # the last step whose ladder metrics or findings were logged
        self.measuring: int | None = None
        self.order: list[str] = []  # a resumed run's forward order, until the meter has its own
        self._resumed_every: int | None = None  # a resumed run's cadence
        self._log: Log | None = None
        self._speaks: Callable[[], bool] = lambda: messages.speaks
        self.positions = True
        self.last_result: LadderResult | None = None
        self._losses: StepMaximum | None = None  # the losses on their way to the host
        self._step_losses: list[torch.Tensor | float] = []  # this step's micro-batches' losses, as handed
        self._fed = False  # a loss was handed over: from then on every step's is judged

    def reset(self) -> None:
        """A new run (a resumed one loads its state after this): nothing logged, no finding raised."""
        self.close()
        self.logged, self.order, self._resumed_every = -1, [], None
        if self.findings is not None:
            self.findings.reset()

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
        self.views = self._views(self.name, self.messages.info, self.messages.warn, images=s.images,
                                 image_every_n_steps=s.image_every_n_steps, summary=s.summary)
        self._speaks, self.positions, self.last_result = speaks, True, None
        self._losses, self._step_losses, self._fed = None, [], False
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
        if not (self.due(step) or self.wants_measurement):
            return False
        self.measuring = step
        self.meter.start()
        return True

    def use_batch(self, batch) -> None:
        """A micro-batch of the measured step: its padding is left out of the rows."""
        if self.measuring is not None:
            self.meter.use_batch(batch)

    @property
    def wants_measurement(self) -> bool:
        """Whether the next step is measured whatever the cadence: the loss rule fired, and its
        finding is said with that step's figures."""
        return self.findings is not None and self.findings.pending_loss is not None

    @property
    def judges_loss(self) -> bool:
        """Whether the findings judge the training loss (``loss_blowup`` on): a callback hands it over."""
        return self.findings is not None and self.findings.thresholds.get("loss_blowup") is not None

    def add_loss(self, value) -> None:
        """One micro-batch's training loss (a one-element tensor or a number), judged at the step's
        end; None is no loss; anything else is left out, said once."""
        if self.meter is None or not self.judges_loss or value is None:
            return
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            self._step_losses.append(value.detach())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self._step_losses.append(float(value))
        else:
            shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
            given = f"{type(value).__name__}{shape}"
            self.messages.warn("loss", f"{self.name}: the loss handed over is a {given}, not a number or a "
                                       "one-element tensor: the loss rule (loss_blowup) leaves it out.")
        self._fed = self._fed or bool(self._step_losses)

    def end_step(self, step: int, stop: Callable[[], object], *, judge_loss: bool = True,
                 write_image=None, counts: bool = False, label: str | None = None) -> dict[str, float] | None:
        """Optimizer step ``step`` ended (every process calls this together): the findings read its
        every-step growth and, with ``judge_loss``, the loss handed over (a kind raised or ended
        is logged at once unless the step is measured); then, when it was measured: unhook, merge
        over processes, read the findings, log, keep for the summary and draw.  ``stop()``: a
        finding asked the run to stop.  Returns the measured step's metrics (None: not measured)."""
        measured, self.measuring = self.measuring, None
        reading = every_step(self.findings, self.meter, step, stop)
        if measured is None and (reading.raised or reading.ended):
            self.log(step, reading.metrics)
        if judge_loss:
            self._judge_loss(step, stop, across=True)
        if measured is None:
            return None
        self.meter.stop()
        result = self.meter.result(merge=True, counts=counts, label=label or f"step {step}")
        if result is None:
            return None
        self.last_result = result
        metrics = result.metrics(positions=self.positions)
        metrics.update(health(self.findings, step, result, stop))
        logged = self.log(step, metrics, result)
        self.positions = self.positions and not logged
        if logged and self._speaks():
            self.views.step(write_image, result, step, step == self.last_step)
        return metrics

    def judge_loss(self, step: int, stop: Callable[[], object]) -> None:
        """The losses handed over since the last call, judged at ``step`` (a framework that logs its
        loss apart from its steps: the same on every process)."""
        self._judge_loss(step, stop, across=False)

    def _judge_loss(self, step: int, stop: Callable[[], object], *, across: bool) -> None:
        """The mean of the step's micro-batches' losses to the findings' loss rule (``loss_blowup``);
        a kind raised or ended is logged at once.  Nothing waits for the device: on a GPU the loss
        is read a step later.  Of several processes the largest is judged (one 8-byte all-reduce;
        every process calls this at every step), so all say and stop alike; ``across=False``: the
        loss is the same on every process already.  Nothing before the first loss handed over (a
        loop that gives none pays nothing)."""
        if not (self.judges_loss and self._fed):
            return
        if self._losses is None:
            self._losses = StepMaximum(across and several_processes())
        values, self._step_losses = self._step_losses, []
        on_host = all(not isinstance(v, torch.Tensor) or v.device.type == "cpu" for v in values)
        if on_host and not self._losses.across:  # nothing to wait for or to reduce: read it now
            taken = (step, sum(map(float, values)) / len(values)) if values else None
        else:
            tensors = [torch.as_tensor(v).float().reshape(()) for v in values]
            mean = torch.stack(tensors).mean() if tensors else None
            device = mean.device if mean is not None else next(self.meter.model.parameters()).device
            taken = self._losses.close(step, mean, False, device)
        if taken is None:
            return
        reading = self.findings.read_loss(*taken)
        if self.findings.pending_loss is not None and self.meter.off_reason is not None:
            reading = self.findings.say_pending_loss()  # no step can be measured to say it with
        if reading.stop:
            stop()
        if reading.raised or reading.ended:
            self.log(taken[0], reading.metrics)

    def log(self, step: int, metrics: dict[str, float], result: LadderResult | None = None) -> bool:
        """``metrics`` of ``step`` through the framework's logging, and kept for the summary (the
        process that speaks); True when this process logged them."""
        logged = self._log(step, metrics, result)
        if logged:
            self.logged = max(self.logged, step)
            if self._speaks():
                self.views.add(step, metrics)
        return logged

    def probe(self, step: int, log: Log, *, end: bool = False) -> None:
        """The invariance probe's run at ``step`` when its cadence (``invariance_every_n_steps``) has
        one there, or with ``end`` the run after the last update with its scale sweep; unless it
        was taken: its metrics through ``log`` and kept for the summary."""
        every = self.settings.invariance_every_n_steps
        if every is None or not (end or step % every == 0):
            return
        taken = self.runs.take(step, sweep=end)
        if taken is not None and log(step, taken[0], None) and self._speaks():
            self.views.add(step, taken[0])

    def end(self, write_image=None) -> None:
        """The run ended: the ladder over training (a picture, through ``write_image``) and the
        summary (the process that speaks, once), with the settings that differ from the defaults,
        the finding kinds watched and the start they judged from; a failure there is said and the
        run goes on."""
        self.close()
        if self.views is None or not self._speaks():
            return
        watched, start = [], None
        if self.findings is not None:
            watched = [f"{kind} above {threshold:g}" for kind, threshold in self.findings.thresholds.items()
                       if threshold is not None]
            start = self.findings.start
        title = f"{model_class(self.meter.model)}, end of training"
        try:
            self.views.end(write_image, title, watched, start, self.settings.changed())
        except Exception as err:  # noqa: BLE001 - the end-of-run views must never fail a run
            self.messages.warn("end", f"{self.name}: no end-of-run summary or picture: {err!r}")

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
