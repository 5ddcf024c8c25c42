"""What every monitor does after a training step, written once, so the monitors are at parity by
construction.

A monitor (the Lightning callback, the ``transformers.Trainer`` callback, the plain loop's)
maps its framework's events to three calls of one :class:`AfterStep` and gives it how its
framework logs (``log(step, metrics, result) -> bool``) and draws (``write_image``):

* :meth:`AfterStep.every_step` -- every optimizer step: the every-step growth read by the
  findings (:func:`~lnmonitor.core.findings.reader.every_step`), its health logged at once
  when a finding was raised or ended on a step that is not measured;
* :meth:`AfterStep.loss` -- a step's training loss, where the monitor has it: the findings' loss
  rule, logged at once as the growth is;
* :meth:`AfterStep.measured` -- a measured step: the meter's result, its metrics (each norm's
  ladder position with the first logged one), the findings' health, logged, kept for the
  summary, and the ladder's picture;
* :meth:`AfterStep.end` -- once at the end: the ladder over training and the summary.

The views (:class:`lnmonitor.views.run_views.RunViews`) come from the monitor: this level draws
nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from lnmonitor.core.findings.reader import FindingsReader, every_step, health
from lnmonitor.core.meter.processes import StepMaximum, several_processes

if TYPE_CHECKING:
    from lnmonitor.core.meter.meter import LadderMeter, LadderResult

__all__ = ["AfterStep", "Log"]

Log = Callable[[int, dict, "LadderResult | None"], bool]
"""``log(step, metrics, result)``: the monitor's framework logs ``metrics`` at ``step`` (``result``:
the measured step's, None for the every-step health); True when this process logged them."""


class Views(Protocol):
    def add(self, step: int, metrics: dict[str, float]) -> None: ...
    def step(self, write, result, step: int, last: bool = False) -> None: ...
    def end(self, write, title: str, watched: Sequence[str] | None = None,
            start: tuple[int, float] | None = None, settings: Mapping[str, object] | None = None) -> None: ...


class AfterStep:
    """The post-step sequence of one run of a monitor.

    Args:
        meter: the monitor's :class:`~lnmonitor.core.meter.meter.LadderMeter`.
        findings: its :class:`~lnmonitor.core.findings.reader.FindingsReader`, or None (off).
        views: its pictures and summary (rank zero's).
        speaks: whether this process draws and keeps the summary (rank zero).
        warn: ``warn(key, text)``, said once per key.
        name: the name messages start with.
    """

    def __init__(self, meter: LadderMeter, findings: FindingsReader | None, views: Views, *,
                 speaks: Callable[[], bool], warn: Callable[[str, str], None], name: str) -> None:
        self.meter, self.findings, self.views = meter, findings, views
        self._speaks, self._warn, self.name = speaks, warn, name
        self.positions = True  # each norm's ladder position goes with the first logged measured step
        self.last_result: LadderResult | None = None
        self._losses: StepMaximum | None = None  # the losses on their way to the host
        self._step_losses: list[torch.Tensor | float] = []  # this step's micro-batches' losses, as handed
        self._fed = False  # a loss was handed over: from then on every step's is judged

    def every_step(self, step: int, log: Log, stop: Callable[[], object], *, measured: bool) -> bool:
        """Optimizer step ``step`` ended: the findings read its every-step growth; a kind raised
        or ended is logged at once unless the step is ``measured`` (then it goes with its
        metrics).  ``stop()``: ``on_finding`` asked the run to stop.  True when it logged."""
        reading = every_step(self.findings, self.meter, step, stop)
        if not measured and (reading.raised or reading.ended):
            return self.log(step, reading.metrics, log)
        return False

    @property
    def wants_measurement(self) -> bool:
        """Whether the monitor should measure its next step whatever its cadence: the loss rule
        fired, and its finding is said with that step's figures."""
        return self.findings is not None and self.findings.pending_loss is not None

    @property
    def judges_loss(self) -> bool:
        """Whether the findings judge the training loss (``loss_blowup`` on): a monitor hands it over then."""
        return self.findings is not None and self.findings.thresholds.get("loss_blowup") is not None

    def add_loss(self, value) -> None:
        """One micro-batch's training loss (a one-element tensor or a number), for :meth:`loss`
        at the step's end; None is no loss; anything else is left out, said once."""
        if not self.judges_loss or value is None:
            return
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            self._step_losses.append(value.detach())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self._step_losses.append(float(value))
        else:
            shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
            self._warn("loss", f"{self.name}: the loss handed over is a {type(value).__name__}{shape}, not "
                               "a number or a one-element tensor: the loss rule (loss_blowup) leaves it out.")
        self._fed = self._fed or bool(self._step_losses)

    def loss(self, step: int, log: Log, stop: Callable[[], object], *, across: bool = True) -> bool:
        """Optimizer step ``step`` ended: the mean of its micro-batches' losses (:meth:`add_loss`;
        none: nothing this step) to the findings' loss rule (``loss_blowup``); a kind raised or
        ended is logged at once.  Nothing waits for the device: on a GPU the loss is read a step
        later.  Of several processes the largest is judged (one 8-byte all-reduce; every process
        calls this at every step), so all say and stop alike; ``across=False``: the loss is the
        same on every process already (the Trainer's logged one).  Nothing before the first
        loss handed over (a monitor, or a loop, that gives none pays nothing).  True when it logged."""
        if not (self.judges_loss and self._fed):
            return False
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
            return False
        reading = self.findings.read_loss(*taken)
        if self.findings.pending_loss is not None and self.meter.off_reason is not None:
            reading = self.findings.say_pending_loss()  # no step can be measured to say it with
        if reading.stop:
            stop()
        if reading.raised or reading.ended:
            return self.log(taken[0], reading.metrics, log)
        return False

    def measured(self, step: int, log: Log, stop: Callable[[], object], *, counts: bool = False,
                 label: str | None = None, write_image=None, last: bool = False) -> dict[str, float] | None:
        """Measured step ``step`` ended: unhook, merge over processes (every process calls this
        together), read the findings and log.  Returns the metrics logged (None: nothing
        measured).  ``last``: the run's last step (it gets a picture)."""
        self.meter.stop()
        result = self.meter.result(merge=True, counts=counts, label=label or f"step {step}")
        if result is None:
            return None
        self.last_result = result
        found = health(self.findings, step, result, stop)
        metrics = result.metrics(positions=self.positions)
        metrics.update(found)
        logged = self.log(step, metrics, log, result)
        self.positions = self.positions and not logged
        if logged and self._speaks():
            self.views.step(write_image, result, step, last)
        return metrics

    def log(self, step: int, metrics: dict[str, float], log: Log, result: LadderResult | None = None) -> bool:
        """``metrics`` of ``step`` to the monitor's ``log``, and kept for the summary (rank zero)."""
        logged = log(step, metrics, result)
        if logged and self._speaks():
            self.views.add(step, metrics)
        return logged

    def end(self, write_image, title: str, settings: Mapping[str, object] | None = None) -> None:
        """The run ended: the ladder over training and the summary titled ``title`` (rank zero,
        once), with the ``settings`` that differ from the defaults, the finding kinds watched and
        the start they judged from; a failure there is said and the run goes on."""
        if not self._speaks():
            return
        watched, start = [], None
        if self.findings is not None:
            watched = [f"{kind} above {threshold:g}" for kind, threshold in self.findings.thresholds.items()
                       if threshold is not None]
            start = self.findings.start
        try:
            self.views.end(write_image, title, watched, start, settings)
        except Exception as err:  # noqa: BLE001 - the end-of-run views must never fail a run
            self._warn("end", f"{self.name}: no end-of-run summary or picture: {err!r}")
