"""The ``transformers.Trainer`` integration: the meter and the invariance probe as a ``TrainerCallback``.
Needs the ``hf`` extra (``pip install 'lnmonitor[hf]'``); nothing else in lnmonitor imports transformers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

try:
    from transformers import Trainer, TrainerCallback
    from transformers.integrations import get_reporting_integration_callbacks
except ImportError as err:  # pragma: no cover - the hf extra is not installed
    raise ImportError(
        "lnmonitor.integrations.transformers needs transformers: pip install 'lnmonitor[hf]'"
    ) from err

from lnmonitor.core.findings.reader import START_GROWTH, state_from_log
from lnmonitor.core.invariance.loss_contract import default_loss
from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.invariance.probe_rows import (
    first_samples,
    labels_problem,
    map_tensors,
    pad_id_of,
    probe_batch,
)
from lnmonitor.core.invariance.runs import SHARDED_REFUSED
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.monitor import arguments
from lnmonitor.core.monitor.monitor import Monitor, MonitorAttributes
from lnmonitor.core.monitor.settings import Settings
from lnmonitor.core.monitor.shared import Messages, guarded
from lnmonitor.core.norms.discovery import NormSelectionError
from lnmonitor.core.output.metric_names import TRAINER_SPLIT, custom_scalars, health_metric
from lnmonitor.core.wrappers import sharded
from lnmonitor.views.run_views import RunViews

__all__ = ["LNMonitorCallback"]


class LNMonitorCallback(MonitorAttributes, TrainerCallback):
    r"""Watch the norms of the model a ``transformers.Trainer`` trains.

    The norms are measured over every micro-batch of the optimizer steps whose update brings ``global_step``
    to a logging step (every ``every_n_steps``, the fit's first: the start later growth is judged against,
    and the last), on every process (merged over ``torch.distributed``), and reported at that
    ``global_step``.  Every ``invariance_every_n_steps`` steps and at the end of training (with its scale
    sweep) the final-norm invariance probe runs on ``probe_size`` held-out rows (the first of the eval
    dataset, batched by the Trainer's collator and padded with the tokenizer's or the config's pad id; else
    the first training rows, said once) with the model's own ``labels`` loss.  The metrics -- the names of
    :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor` and
    :class:`~lnmonitor.lightning.invariance_monitor.FinalNormInvarianceMonitor` -- go from the main process
    to every ``report_to`` integration, which apply their own naming (TensorBoard's and W&B's put
    ``train/`` before every tag; TensorBoard also gets a Custom Scalars layout and the ladder's picture).
    The end-of-run point is reported at the last epoch's end, before the integrations close, and the
    summary printed.  Only what the findings need goes to ``state.log_history`` (saved by every checkpoint,
    so a resumed fit raises no kind again and judges growth from the same start):
    ``{"lnmonitor/health/<kind>": 1.0, "step": global_step}`` when a kind is raised (0.0 when it stops
    holding) and ``lnmonitor/ladder/growth`` at the fit's first step.

    Args:
        trainer: the ``transformers.Trainer`` to report through
            (``trainer.add_callback(LNMonitorCallback(trainer))``): its ``report_to`` integrations get the
            metrics and its eval data the probe's rows.  Without it the metrics are kept in :attr:`history`
            only (said once) and the probe takes the first training rows.
        settings: a :class:`~lnmonitor.core.monitor.settings.Settings` (``every_n_steps`` defaults to the
            Trainer's ``logging_steps``), or its fields as keyword arguments.  ``on_finding`` returning True
            stops training (``control.should_training_stop``); ``loss_blowup`` reads the loss the Trainer
            logs (its mean since the last log), at its ``logging_steps``.

    Raises:
        lnmonitor.core.monitor.arguments.ArgumentError: an argument of the wrong type or range.
        lnmonitor.core.norms.discovery.NormSelectionError: when training begins, if the model has no norm it
            can measure as asked.

    Example::

        >>> from lnmonitor.integrations.transformers import LNMonitorCallback
        >>> # trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        >>> # trainer.add_callback(LNMonitorCallback(trainer, every_n_steps=50))

    Every event runs inside :func:`~lnmonitor.core.monitor.shared.guarded`: an exception there turns the
    callback off with one warning (:attr:`off_reason`), and training goes on; a failing integration is
    dropped with one warning.  Under FSDP and DeepSpeed ZeRO-3 the invariance probe is off (said once:
    :data:`~lnmonitor.core.invariance.runs.SHARDED_REFUSED`).
    """

    configuration_errors = (arguments.ArgumentError, NormSelectionError)

    def __init__(self, trainer=None, *, settings: Settings | None = None, **fields) -> None:
        if trainer is not None and not isinstance(trainer, Trainer):
            raise arguments.ArgumentError(
                f"trainer must be the transformers.Trainer this callback is added to, or None, got "
                f"{type(trainer).__name__}: pass the settings by name, LNMonitorCallback(every_n_steps=...)")
        self.trainer = trainer
        self.settings = Settings.build(settings, fields, "LNMonitorCallback")
        self.name = "LNMonitorCallback"
        self.messages = Messages()
        self.monitor = Monitor(self.settings, self.name, self.messages, RunViews, first_step=1)
        self.findings = self.monitor.findings
        self.off_reason: str | None = None
        self.meter: LadderMeter | None = None
        self._runs = self.monitor.runs
        self._reporters: list = []
        self._main = True
        self._held: set[str] = set()  # the finding kinds holding as last kept in log_history
        self._layout_written = False

    @guarded(starts_run=True)
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._main = state.is_world_process_zero
        self.messages.reset(speaks=self._main)
        self.monitor.reset()
        if self.findings is not None:  # each kind is raised once per fit; a resumed fit's are in log_history
            self.findings.load_state_dict(state_from_log(state.log_history))
        self._held = set(self.findings.holding) if self.findings is not None else set()
        self._layout_written = False

        def log(step: int, metrics: dict[str, float], result) -> bool:
            self._keep_health(state, metrics)
            return self._report(metrics, args, state, control)

        self.meter = self.monitor.begin(model, log, speaks=lambda: self._main, last_step=state.max_steps,
                                        every_n_steps=_logging_steps(args.logging_steps, state.max_steps))
        callbacks = self.trainer.callback_handler.callbacks if self.trainer is not None else []
        integrations = tuple(get_reporting_integration_callbacks(args.report_to))
        self._reporters = [cb for cb in callbacks if isinstance(cb, integrations)]
        if self.trainer is None:
            self.messages.warn("no-trainer", "LNMonitorCallback: no transformers.Trainer was handed to it, "
                                             "so its metrics go to no report_to integration: they are kept "
                                             "in the callback's .history. Pass it the Trainer to report "
                                             "them: trainer.add_callback(LNMonitorCallback(trainer)).")
        self.monitor.history.reset(receivers=bool(self._reporters))
        self._runs.begin(None, None)
        if self.settings.invariance_every_n_steps is not None:
            self._start_probe(model, kwargs)

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        self.monitor.start(state.global_step + 1)  # the step is named by global_step after its update

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor.views is None:  # no training began through on_train_begin: nothing to do
            return
        stop = lambda: setattr(control, "should_training_stop", True)  # noqa: E731
        self.monitor.end_step(state.global_step, stop, judge_loss=False, write_image=self._image_writer())
        self._run_probe(args, state, control)

    @guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        """The Trainer logged its training loss (its mean since the last log): the loss rule reads it."""
        if self.monitor.views is None or not isinstance(logs, Mapping) or "loss" not in logs:
            return
        self.monitor.add_loss(logs["loss"])
        self.monitor.judge_loss(state.global_step, lambda: setattr(control, "should_training_stop", True))

    @guarded
    def on_epoch_end(self, args, state, control, **kwargs):
        # the end of training comes here before on_train_end, where the integrations close
        if control.should_training_stop or state.global_step >= state.max_steps:
            self._run_probe(args, state, control, end=True)
            self.monitor.end(self._image_writer())

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self.detach()

    def _keep_health(self, state, metrics: Mapping[str, float]) -> None:
        """Append to ``state.log_history`` what a resumed fit restores (``state_from_log``): the health tags
        that changed since last kept, and the ladder's growth at the fit's start."""
        if self.findings is None:
            return
        now = set(self.findings.holding)
        kept = {health_metric(kind): float(kind in now) for kind in sorted(self._held ^ now)}
        self._held = now
        if self.findings.start is not None and self.findings.start[0] == state.global_step:
            kept[START_GROWTH] = metrics.get(START_GROWTH, self.findings.start[1])
        if kept:
            state.log_history.append({**kept, "step": state.global_step})

    def _probe_rows(self, model, kwargs):
        """The probe's rows from the Trainer's eval loader, else the first training rows (said once)."""
        pad = pad_id_of(model, kwargs.get("processing_class"))
        info = lambda text: self.messages.info(f"LNMonitorCallback: {text}.")  # noqa: E731
        warn = lambda text: self.messages.warn("probe-rows", f"LNMonitorCallback: {text}.")  # noqa: E731
        size, trainer = self.settings.probe_size, self.trainer
        if trainer is not None and trainer.eval_dataset is not None:
            batch = first_samples(trainer.get_eval_dataloader(), size, pad=pad, info=info, warn=warn)
            if batch is not None:
                return batch
        batch = first_samples(kwargs.get("train_dataloader"), size, pad=pad, info=info, warn=warn)
        if batch is not None:
            why = ("no eval dataset to take held-out probe rows from" if trainer is not None else
                   "no Trainer was handed to it, so it cannot read the eval set")
            self.messages.warn("train-probe", f"LNMonitorCallback: {why}, so the invariance probe runs on "
                                              "the first training rows.")
        return batch

    def _start_probe(self, model, kwargs) -> None:
        if not self._main:
            return  # the main process probes, alone
        if sharded(model):
            self._runs.off(SHARDED_REFUSED)
            return
        trainer, batch = self.trainer, self._probe_rows(model, kwargs)
        labels = (getattr(trainer, "label_names", None) if trainer is not None else None) or ["labels"]
        problem = labels_problem(batch, labels)
        if problem is not None:
            self._runs.off(problem)
            return
        device = next(model.parameters()).device
        rows = map_tensors(probe_batch(batch, self.settings.probe_size), lambda t: t.to(device))
        autocast = trainer.autocast_smart_context_manager if trainer is not None else contextlib.nullcontext
        s = self.settings
        probe = InvarianceProbe(model, default_loss, final_norm=s.final_norm, cases=s.cases, scales=s.scales,
                                meter=self.meter, autocast=autocast)
        self._runs.begin(probe, rows)

    def _run_probe(self, args, state, control, *, end: bool = False) -> None:
        report = lambda step, metrics, result: self._report(metrics, args, state, control)  # noqa: E731
        self.monitor.probe(state.global_step, report, end=end)

    def _report(self, metrics: dict[str, float], args, state, control) -> bool:
        """To every ``report_to`` integration of the Trainer, from the main process; True when reported."""
        if not self._main or not metrics:
            return False
        self.monitor.history.add(state.global_step, metrics)
        if not self._layout_written:
            self._layout_written = True
            self._write_layout()
        for reporter in list(self._reporters):
            try:
                reporter.on_log(args, state, control, logs=dict(metrics))
            except Exception as err:  # noqa: BLE001 - a reporter must never stop training
                self._reporters.remove(reporter)
                self.messages.warn(f"report-{type(reporter).__name__}", f"LNMonitorCallback: "
                                   f"{type(reporter).__name__} failed ({err!r}); nothing more goes to it "
                                   "(training goes on).")
        return True

    def _image_writer(self):
        """``write(tag, image, step)`` into the Trainer's TensorBoard writer (under ``train/``), or None."""
        writers = [w for cb in self._reporters if (w := getattr(cb, "tb_writer", None)) is not None]
        if not writers or not self._main:
            return None
        return lambda tag, image, step: writers[0].add_image(f"{TRAINER_SPLIT}/{tag}", image, step,
                                                             dataformats="HWC")

    def _write_layout(self) -> None:
        """The Custom Scalars layout, for the tags as the Trainer's TensorBoard writes them."""
        layout = custom_scalars(self.settings.invariance_every_n_steps is not None, f"{TRAINER_SPLIT}/")
        for reporter in self._reporters:
            writer = getattr(reporter, "tb_writer", None)
            if callable(getattr(writer, "add_custom_scalars", None)):
                try:
                    writer.add_custom_scalars(layout)
                except Exception as err:  # noqa: BLE001 - a layout must never stop training
                    self.messages.warn("layout",
                                       f"LNMonitorCallback: no Custom Scalars layout written ({err!r}).")


def _logging_steps(value: float, max_steps: int) -> int:
    """The Trainer's ``logging_steps`` as a number of steps (a value below 1 is a ratio of ``max_steps``)."""
    if 0 < value < 1:
        return max(math.ceil(value * max_steps), 1)
    return max(int(value), 1)
