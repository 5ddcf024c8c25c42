"""The ``transformers.Trainer`` door: the meter and the invariance probe as a ``TrainerCallback``.

Needs the ``hf`` extra (``pip install 'lnmonitor[hf]'``); nothing else in lnmonitor imports
transformers.  How it reaches the Trainer's reporting integrations and its eval data
without being handed the Trainer: see :func:`_running_trainer`.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Mapping, Sequence

try:
    from transformers import Trainer, TrainerCallback
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
except ImportError as err:  # pragma: no cover - the hf extra is not installed
    raise ImportError(
        "lnmonitor.integrations.transformers needs transformers: pip install 'lnmonitor[hf]'"
    ) from err

from lnmonitor.core.after_step import AfterStep
from lnmonitor.core.findings.reader import door_reader, reads_growth, state_from_health
from lnmonitor.core.hooks import model_class, sharded
from lnmonitor.core.invariance.loss_contract import default_loss
from lnmonitor.core.invariance.points import SHARDED_REFUSED, InvariancePoints
from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.invariance.probe_rows import first_samples, map_tensors, pad_id_of, probe_batch
from lnmonitor.core.invariance.results import PROBE_WINDOWS
from lnmonitor.core.meter.meter import LadderMeter, LadderResult
from lnmonitor.core.monitor import arguments
from lnmonitor.core.monitor.shared import History, Voice, due, guarded
from lnmonitor.core.norms.discovery import NormSelectionError
from lnmonitor.core.output.metric_names import (
    CATEGORY_ORDER,
    INVARIANCE_LAYOUT,
    LADDER_LAYOUT,
    TRAINER_SPLIT,
    health_metric,
    ladder_metric,
    parse,
)
from lnmonitor.core.settings import LadderSettings
from lnmonitor.views.run_views import RunViews

__all__ = ["LNMonitorCallback"]

START_GROWTH = ladder_metric("growth")  # kept in log_history at the fit's start, for a resumed fit


class LNMonitorCallback(TrainerCallback):
    r"""Watch the norms of the model a ``transformers.Trainer`` trains.

    The norms are measured over every micro-batch of the optimizer steps whose update brings
    the Trainer's ``global_step`` to a logging step -- every ``every_n_steps`` (default: the
    Trainer's ``logging_steps``), the fit's first (the model before any update: the start every
    later step's growth is judged against, whatever the cadence) and the last -- on
    every process (merged over ``torch.distributed`` under ``accelerate``/``torchrun``), and
    reported at that ``global_step``, where the Trainer logs its loss.  Every
    ``invariance_every_n_steps`` steps and at the end of training (with its scale sweep) the
    final-norm invariance probe runs on ``probe_size`` held-out rows (the first of the eval
    dataset, batched by the Trainer's collator and joined across padded lengths with the
    tokenizer's or the model config's pad id; else the first training rows, said once) with
    the model's own ``labels`` loss (``model(**batch).loss``).  The metrics -- the names of
    :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor` and
    :class:`~lnmonitor.lightning.invariance_monitor.FinalNormInvarianceMonitor` -- go from
    the main process to every ``report_to`` integration (TensorBoard, W&B, MLflow, ...),
    which apply their own naming (TensorBoard's and W&B's put ``train/`` before every tag;
    TensorBoard also gets a Custom Scalars layout for those tags).  The end-of-run point is
    reported at the last epoch's end, before the integrations close: one event file per
    run.  Of these metrics only what the findings need goes to ``state.log_history`` (which every
    checkpoint saves): ``{"lnmonitor/health/<kind>": 1.0, "step": global_step}`` when a kind is
    raised (0.0 when it stops holding) and the ladder's growth at the fit's first step
    (``lnmonitor/ladder/growth``), so that ``train(resume_from_checkpoint=...)``, the same fit,
    does not raise a kind again and judges the growth from the same start.  As every
    monitor does, it logs the ladder's picture (to the Trainer's TensorBoard writer, when it
    reports to TensorBoard) and prints the one-screen summary at the end of training.

    Args:
        trainer: not needed (``Trainer(..., callbacks=[LNMonitorCallback()])``); kept for
            ``trainer.add_callback(LNMonitorCallback(trainer))``, which works as before.
        every_n_steps: measure the norms every this many optimizer steps; None: the
            Trainer's ``logging_steps``.
        include, exclude, final_norm, ladder: as for ``LayerNormMonitor``.
        row_mask: which rows (tokens) to measure: None (default) leaves out the padding of
            each batch (its ``attention_mask``), said once; ``False``
            measures every row; a callable ``row_mask(inputs)`` of the model's keyword inputs
            returns a bool tensor of the rows to measure.
        invariance_every_n_steps: run the invariance probe every this many steps (and at
            the end); None: never.
        probe_size: the probe's rows (default 64, as ``FinalNormInvarianceMonitor``).
        keep_history: keep every reported dict in :attr:`history`; None keeps them only
            when the Trainer reports to no integration.
        images: write the ladder pictures (``train/lnmonitor/ladder`` at most every
            ``image_every_n_steps``, and ``train/lnmonitor/ladder_over_training`` at the end) to
            the Trainer's TensorBoard writer; nothing without ``report_to="tensorboard"``.
        image_every_n_steps: the least number of steps between two ladder pictures.
        summary: print the one-screen summary of the run at the end of training (main process).
        findings, on_finding: as for :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor`
            (docs/findings.md); ``on_finding`` returning True stops training
            (``control.should_training_stop``).  ``loss_blowup`` reads the loss the Trainer logs
            (its mean since the last log: the Trainer hands its callbacks no step's loss), at its
            ``logging_steps``.

    Raises:
        lnmonitor.core.monitor.arguments.ArgumentError: an argument of the wrong type or range.
        lnmonitor.core.norms.discovery.NormSelectionError: when training begins, if the model has no
            norm it can measure as asked.

    Example::

        >>> from lnmonitor.integrations.transformers import LNMonitorCallback
        >>> # trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
        >>> #                                callbacks=[LNMonitorCallback(every_n_steps=50)])

    Every event runs inside :func:`~lnmonitor.core.monitor.shared.guarded`: an exception there turns the
    callback off with one warning naming the cause (:attr:`off_reason`), and training goes on;
    a failing integration is dropped with one warning.  Under FSDP and DeepSpeed ZeRO-3 the
    invariance probe is off (said once: :data:`~lnmonitor.core.invariance.points.SHARDED_REFUSED`);
    the Lightning and plain-loop doors probe a sharded model on every process.
    """

    refusals = (arguments.ArgumentError, NormSelectionError)

    def __init__(
        self,
        trainer=None,
        every_n_steps: int | None = None,
        *,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        final_norm: str | None = None,
        ladder: str | Sequence[str] | None = None,
        row_mask: Callable | bool | None = None,
        invariance_every_n_steps: int | None = 1000,
        probe_size: int | None = PROBE_WINDOWS,
        keep_history: bool | None = None,
        images: bool = True,
        image_every_n_steps: int = 50,
        summary: bool = True,
        findings: Mapping[str, float | None] | bool | None = None,
        on_finding: Callable | None = None,
    ) -> None:
        if trainer is not None and not isinstance(trainer, Trainer):
            raise arguments.ArgumentError(
                f"trainer must be the transformers.Trainer this callback is added to, or None (it is "
                f"found when training begins), got {type(trainer).__name__}: pass the other arguments by "
                "name, LNMonitorCallback(every_n_steps=...)"
            )
        self.trainer = trainer
        self.settings = LadderSettings(
            every_n_steps=every_n_steps, include=include, exclude=exclude, final_norm=final_norm,
            ladder=ladder, row_mask=row_mask, images=images, image_every_n_steps=image_every_n_steps,
            summary=summary, keep_history=keep_history)
        self.invariance_every_n_steps = arguments.positive_int(invariance_every_n_steps,
                                                               "invariance_every_n_steps")
        self.probe_size = arguments.positive_int(probe_size, "probe_size", unit="samples")
        self._kept = History(self.settings.keep_history)
        self.owner = "LNMonitorCallback"
        self.voice = Voice()
        self.findings = door_reader(findings, on_finding, lambda: self.voice.speaks, self.owner,
                                    self.voice.say)
        self.off_reason: str | None = None
        self.meter: LadderMeter | None = None
        self.every_n_steps: int | None = self.settings.every_n_steps
        self._points = InvariancePoints(self.owner, self.voice)
        self._reporters: list = []
        self._measuring: int | None = None
        self._main = True
        self._logged = -1
        self._layout_written = False
        self._after: AfterStep | None = None  # the fit's post-step sequence, views and summary

    @property
    def last_result(self) -> LadderResult | None:
        """The last measured step's result."""
        return self._after.last_result if self._after is not None else None

    @property
    def history(self) -> list[dict[str, float]]:
        """Every reported dict, with its ``step`` (see ``keep_history``)."""
        return self._kept.rows

    def shut(self) -> None:
        """Remove every hook and forget the step in progress (the guard tripped, or training ended)."""
        self._measuring = None
        if self.meter is not None:
            self.meter.close()

    # -- training ----------------------------------------------------------------------

    @guarded(starts_run=True)
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._main = state.is_world_process_zero
        self.voice.reset(speaks=self._main)
        if self.findings is not None:  # each kind is raised once per fit; a resumed fit's are in log_history
            self.findings.load_state_dict(state_from_health(*_health_points(state.log_history)))
        self._logged = -1
        self._layout_written = False
        trainer = self.trainer or _running_trainer(self)
        self.every_n_steps = (self.settings.every_n_steps
                              or _logging_steps(args.logging_steps, state.max_steps))
        self.meter = self.settings.meter(model, self.owner, self.voice.say, self.voice.warn,
                                         watch_growth=reads_growth(self.findings))
        self._after = AfterStep(self.meter, self.findings, self._new_views(), speaks=lambda: self._main,
                                warn=self.voice.warn, owner=self.owner)
        callbacks = trainer.callback_handler.callbacks if trainer is not None else []
        self._reporters = [cb for cb in callbacks if type(cb) in INTEGRATION_TO_CALLBACK.values()]
        if trainer is None:
            self.voice.warn("no-trainer", "LNMonitorCallback: no transformers.Trainer runs this callback's "
                                          "events (none on the call stack holds it), so its metrics go to no "
                                          "report_to integration: they are kept in .history.")
        self._kept.reset(receivers=bool(self._reporters))
        self._points.begin(None, None)
        if self.invariance_every_n_steps is not None:
            self._start_probe(trainer, model, kwargs)

    def _due(self, after: int, max_steps: int) -> bool:
        """Whether the update that brings ``global_step`` to ``after`` is measured: the fit's
        first, every ``every_n_steps``-th (where the Trainer logs its loss) and the last."""
        return (after % self.every_n_steps == 0 or after == max_steps or after == 1) and after > self._logged

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        if self.meter is None or self.meter.off_reason or self._measuring is not None:
            return
        after = state.global_step + 1
        if self._due(after, state.max_steps) or self._after.wants_measurement:
            self._measuring = after
            self.meter.start()

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        if self._after is None:  # no training began through on_train_begin: nothing to do
            return
        stop = lambda: setattr(control, "should_training_stop", True)  # noqa: E731
        log = self._log(args, state, control)
        step = state.global_step
        if self._after.every_step(step, log, stop, measured=self._measuring is not None):
            self._logged = step  # said at the step the every-step growth crossed
        if self._measuring is not None:
            self._measuring = None
            metrics = self._after.measured(step, log, stop, write_image=self._image_writer(),
                                           last=step >= state.max_steps)
            if metrics is not None:
                self._logged = step
        every = self.invariance_every_n_steps
        if every is not None and due(state.global_step, every):
            self._run_probe(args, state, control, sweep=False)

    @guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        """The Trainer logged its training loss (the mean since its last log, the same on every
        process): the findings' loss rule reads it."""
        if self._after is None or not isinstance(logs, Mapping) or "loss" not in logs:
            return
        self._after.add_loss(logs["loss"])
        stop = lambda: setattr(control, "should_training_stop", True)  # noqa: E731
        self._after.loss(state.global_step, self._log(args, state, control), stop, across=False)

    @guarded
    def on_epoch_end(self, args, state, control, **kwargs):
        # the end of training comes here before on_train_end, where the integrations close
        if control.should_training_stop or state.global_step >= state.max_steps:
            if self.invariance_every_n_steps is not None:
                self._run_probe(args, state, control, sweep=True)
            if self._after is not None:
                self._after.end(self._image_writer(), f"{model_class(self.meter.model)}, end of training")

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self.shut()

    def _log(self, args, state, control):
        """The door's ``log(step, metrics, result)`` for this event: to the reporters, and to
        ``state.log_history`` what a resumed fit restores (the health tags that change from
        here, the fit's start)."""
        held = set(self.findings.holding) if self.findings is not None else set()

        def log(step: int, metrics: dict[str, float], result) -> bool:
            self._keep_health(state, held, metrics)
            return self._report(metrics, args, state, control)

        return log

    def _keep_health(self, state, held: set[str], metrics: Mapping[str, float]) -> None:
        """Append to ``state.log_history`` what a resumed fit restores (:func:`_health_points`):
        the health tags that changed at this step (``held``: the kinds that held before it), and
        the ladder's growth at the fit's start, the step the findings judge from."""
        if self.findings is None:
            return
        now = self.findings.holding
        kept = {health_metric(kind): float(kind in now) for kind in sorted(held ^ now)}
        if self.findings.start is not None and self.findings.start[0] == state.global_step:
            kept[START_GROWTH] = metrics.get(START_GROWTH, self.findings.start[1])
        if kept:
            state.log_history.append({**kept, "step": state.global_step})

    # -- the invariance probe ----------------------------------------------------------

    def _probe_rows(self, trainer, model, kwargs):
        """The probe's rows from the eval data (the Trainer's eval loader), else from the first
        training rows (said once); None when there are none."""
        pad = pad_id_of(model, kwargs.get("processing_class"))
        say = lambda text: self.voice.say(f"LNMonitorCallback: {text}.")  # noqa: E731
        warn = lambda text: self.voice.warn("probe-rows", f"LNMonitorCallback: {text}.")  # noqa: E731
        if trainer is not None and trainer.eval_dataset is not None:
            batch = first_samples(trainer.get_eval_dataloader(), self.probe_size, pad=pad, say=say, warn=warn)
            if batch is not None:
                return batch
        batch = first_samples(kwargs.get("train_dataloader"), self.probe_size, pad=pad, say=say, warn=warn)
        if batch is not None:
            self.voice.warn("train-probe", "LNMonitorCallback: no eval dataset to take held-out probe rows "
                                           "from, so the invariance probe runs on the first training rows.")
        return batch

    def _start_probe(self, trainer, model, kwargs) -> None:
        if not self._main:
            return  # the main process probes, alone
        if sharded(model):
            self._points.off(SHARDED_REFUSED)
            return
        batch = self._probe_rows(trainer, model, kwargs)
        labels = (getattr(trainer, "label_names", None) if trainer is not None else None) or ["labels"]
        problem = _unusable(batch, labels)
        if problem is not None:
            self._points.off(problem)
            return
        device = next(model.parameters()).device
        rows = map_tensors(probe_batch(batch, self.probe_size), lambda t: t.to(device))
        autocast = trainer.autocast_smart_context_manager if trainer is not None else contextlib.nullcontext
        probe = InvarianceProbe(model, default_loss, final_norm=self.settings.final_norm, meter=self.meter,
                                autocast=autocast)
        self._points.begin(probe, rows)

    def _run_probe(self, args, state, control, *, sweep: bool) -> None:
        taken = self._points.take(state.global_step, sweep=sweep)
        if taken is not None:
            report = lambda step, metrics, result: self._report(metrics, args, state, control)  # noqa: E731
            self._after.log(state.global_step, taken[0], report)

    @property
    def invariance_off(self) -> str | None:
        """Why the invariance probe is off for this run (None while it is on)."""
        return self._points.off_reason

    # -- reporting ---------------------------------------------------------------------

    def _report(self, metrics: dict[str, float], args, state, control) -> bool:
        """To every ``report_to`` integration of the Trainer, from the main process; True when
        reported."""
        if not self._main or not metrics:
            return False
        self._kept.add(state.global_step, metrics)
        if not self._layout_written:
            self._layout_written = True
            self._write_layout()
        for reporter in list(self._reporters):
            try:
                reporter.on_log(args, state, control, logs=dict(metrics))
            except Exception as err:  # noqa: BLE001 - a reporter must never stop training
                self._reporters.remove(reporter)
                self.voice.warn(f"report-{type(reporter).__name__}",
                           f"LNMonitorCallback: {type(reporter).__name__} failed ({err!r}); nothing more "
                           "goes to it (training goes on).")
        return True

    def _new_views(self) -> RunViews:
        return RunViews.of(self.settings, self.owner, self.voice.say, self.voice.warn)

    def _image_writer(self):
        """``write(tag, image, step)`` into the Trainer's TensorBoard writer (its tags under
        ``train/``), or None: not the main process, no TensorBoard, or it is closed."""
        writers = [w for cb in self._reporters if (w := getattr(cb, "tb_writer", None)) is not None]
        if not writers or not self._main:
            return None
        return lambda tag, image, step: writers[0].add_image(f"{TRAINER_SPLIT}/{tag}", image, step,
                                                             dataformats="HWC")

    def _write_layout(self) -> None:
        """The Custom Scalars layout, for the tags as the Trainer's TensorBoard writes them."""
        categories = {**LADDER_LAYOUT, **(INVARIANCE_LAYOUT if self.invariance_every_n_steps else {})}
        layout = {name: {chart: [kind, [f"{TRAINER_SPLIT}/{regex}" for regex in regexes]]
                         for chart, (kind, regexes) in categories[name].items()}
                  for name in CATEGORY_ORDER if name in categories}
        for reporter in self._reporters:
            writer = getattr(reporter, "tb_writer", None)
            if callable(getattr(writer, "add_custom_scalars", None)):
                try:
                    writer.add_custom_scalars(layout)
                except Exception as err:  # noqa: BLE001 - a layout must never stop training
                    self.voice.warn("layout",
                                    f"LNMonitorCallback: no Custom Scalars layout written ({err!r}).")


def _running_trainer(callback) -> Trainer | None:
    """The ``transformers.Trainer`` running ``callback``'s event: the first on the call stack
    (its training loop calls its ``CallbackHandler``, which calls the callback) whose
    callbacks hold ``callback``; None when there is none.  The events hand a callback the
    model, the data loaders and the tokenizer but neither the Trainer nor the other
    callbacks, and only the Trainer has the reporting integrations (their writers: new ones
    would open a second event file or run) and the eval dataset."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and any(cb is callback for cb in owner.callback_handler.callbacks):
            return owner
        frame = frame.f_back
    return None


def _health_points(log_history: Sequence[Mapping]) -> tuple[list[tuple[int, str, float]], tuple | None]:
    """``(step, kind, value)`` of every ``lnmonitor/health/<kind>`` in the Trainer's
    ``log_history`` (restored from a checkpoint's trainer_state.json before ``on_train_begin``;
    empty on a fresh fit), in its order, and the fit's start ``(step, growth)`` (None: none kept)."""
    points, start = [], None
    for entry in log_history:
        if "step" not in entry:
            continue
        if START_GROWTH in entry and start is None:
            start = (entry["step"], entry[START_GROWTH])
        for tag, value in entry.items():
            metric = parse(tag)
            if metric is not None and metric.group == "health":
                points.append((entry["step"], metric.statistic, value))
    return points, start


def _unusable(batch, label_names: Sequence[str]) -> str | None:
    """Why the probe cannot run ``model(**batch).loss`` on ``batch``, or None."""
    if batch is None:
        return "there is no eval or training data to take probe rows from"
    if not isinstance(batch, Mapping):
        return (f"the collator's batches are a {type(batch).__name__}, not a mapping of tensors: the probe "
                "calls model(**batch) as the Trainer does")
    if not any(name in batch for name in label_names):
        return (f"the probe rows have no {' or '.join(map(repr, label_names))} (their keys: "
                f"{', '.join(map(str, batch))}), so model(**batch) gives no loss: a collator that adds "
                "labels (DataCollatorForLanguageModeling(tokenizer, mlm=False) for a causal LM) gives the "
                "probe one")
    return None


def _logging_steps(value: float, max_steps: int) -> int:
    """The Trainer's ``logging_steps`` as a number of steps (a value below 1 is a ratio of
    ``max_steps``)."""
    if 0 < value < 1:
        return max(math.ceil(value * max_steps), 1)
    return max(int(value), 1)
