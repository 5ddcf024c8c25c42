"""The ``transformers.Trainer`` door: the meter and the invariance probe as a ``TrainerCallback``.

Needs the ``hf`` extra (``pip install 'lnmonitor[hf]'``); nothing else in lnmonitor imports
transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch.distributed as dist

try:
    from transformers import TrainerCallback
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
except ImportError as err:  # pragma: no cover - the hf extra is not installed
    raise ImportError(
        "lnmonitor.integrations.transformers needs transformers: pip install 'lnmonitor[hf]'"
    ) from err

from lnmonitor.core import arguments
from lnmonitor.core.discovery import NormSelectionError, choose_norms
from lnmonitor.core.door import History, Voice, guarded
from lnmonitor.core.hooks import sharded
from lnmonitor.core.invariance import PROBE_WINDOWS, InvarianceProbe, NonFiniteLoss, default_loss
from lnmonitor.core.meter import LadderMeter, LadderResult, due
from lnmonitor.core.probe_rows import first_samples, map_tensors, probe_batch

__all__ = ["LNMonitorCallback"]


class LNMonitorCallback(TrainerCallback):
    r"""Watch the norms of the model a ``transformers.Trainer`` trains.

    At every ``every_n_steps``-th optimizer step (default: the Trainer's
    ``logging_steps``; gradient accumulation does not multiply the count) and at the last,
    the norms are measured over every micro-batch of the step on every process
    (:class:`~lnmonitor.core.meter.LadderMeter`, merged over ``torch.distributed`` under
    ``accelerate``/``torchrun``); every ``invariance_every_n_steps`` steps and at the end of
    training the final-norm invariance probe runs (its scale sweep at the end only) on
    ``probe_size`` held-out rows (the first of the eval dataset, else of the first training
    batch, said once) with the model's own ``labels`` loss (``model(**batch).loss``).  The
    metrics -- the names of :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor` and
    :class:`~lnmonitor.lightning.invariance_monitor.FinalNormInvarianceMonitor`, with
    ``<norm>`` qualified from the Trainer's model -- go from the main process to every
    ``report_to`` integration (TensorBoard, W&B, MLflow, ...) at the Trainer's
    ``global_step`` after the step's update, as its own loss is; the integrations apply
    their own naming (TensorBoard's puts ``train/`` before every tag).  They are not added
    to ``state.log_history``, which every checkpoint saves.

    Args:
        trainer: the ``transformers.Trainer`` this callback is added to (its reporting
            integrations, eval data and autocast are used).
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

    Raises:
        lnmonitor.core.arguments.ArgumentError: an argument of the wrong type or range.
        lnmonitor.core.discovery.NormSelectionError: when training begins, if the model has no
            norm it can measure as asked.

    Example::

        >>> from lnmonitor.integrations.transformers import LNMonitorCallback
        >>> # trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        >>> # trainer.add_callback(LNMonitorCallback(trainer, every_n_steps=50))

    Every event runs inside :func:`~lnmonitor.core.door.guarded`: an exception there turns the
    callback off with one warning naming the cause (:attr:`off_reason`), and training goes on;
    a failing integration is dropped with one warning.  Under FSDP the invariance probe is off
    (said once): the doors probe a sharded model only through Lightning.
    """

    refusals = (arguments.ArgumentError, NormSelectionError)

    def __init__(
        self,
        trainer,
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
    ) -> None:
        if not hasattr(trainer, "callback_handler"):
            raise arguments.ArgumentError(
                f"trainer must be the transformers.Trainer this callback is added to, got "
                f"{type(trainer).__name__}: trainer.add_callback(LNMonitorCallback(trainer))"
            )
        self.trainer = trainer
        self._every_arg = arguments.positive_int(every_n_steps, "every_n_steps")
        self.include = arguments.patterns(include, "include")
        self.exclude = arguments.patterns(exclude, "exclude")
        self.final_norm = arguments.module_name(final_norm, "final_norm", "model.norm")
        self.ladder = arguments.patterns(ladder, "ladder")
        self.row_mask = arguments.row_mask(row_mask)
        self.invariance_every_n_steps = arguments.positive_int(invariance_every_n_steps,
                                                               "invariance_every_n_steps")
        self.probe_size = arguments.positive_int(probe_size, "probe_size", unit="samples")
        self._kept = History(arguments.optional_flag(keep_history, "keep_history"))
        self.owner = "LNMonitorCallback"
        self.voice = Voice()
        self.off_reason: str | None = None
        self.last_result: LadderResult | None = None
        self.meter: LadderMeter | None = None
        self.every_n_steps: int | None = self._every_arg
        self.invariance_off: str | None = None
        self._probe = None
        self._prober: InvarianceProbe | None = None
        self._reporters: list = []
        self._measuring: int | None = None
        self._last_step: int | None = None
        self._main = True
        self._logged = -1
        self._probed = -1

    @property
    def history(self) -> list[dict[str, float]]:
        """Every reported dict, with its ``step`` (see ``keep_history``)."""
        return self._kept.rows

    def _say(self, text: str) -> None:
        self.voice.say(text)

    def _warn(self, key: str, text: str) -> None:
        self.voice.warn(key, text)

    def shut(self) -> None:
        """Remove the hooks and forget the step in progress (the guard tripped)."""
        self._measuring = None
        if self.meter is not None:
            self.meter.abort()

    # -- training ----------------------------------------------------------------------

    @guarded(starts_run=True)
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._main = state.is_world_process_zero
        self.voice.reset(speaks=self._main)
        self._logged, self._probed = -1, -1
        self.every_n_steps = self._every_arg or _logging_steps(args.logging_steps, state.max_steps)
        self._last_step = state.max_steps - 1 if state.max_steps > 0 else None
        self.meter = LadderMeter(
            model, include=self.include, exclude=self.exclude, final_norm=self.final_norm, ladder=self.ladder,
            row_mask=self.row_mask, owner="LNMonitorCallback", say=self._say, warn=self._warn,
        )
        self._reporters = [cb for cb in self.trainer.callback_handler.callbacks
                           if type(cb) in INTEGRATION_TO_CALLBACK.values()]
        self._kept.reset(receivers=bool(self._reporters))
        self._prober, self._probe, self.invariance_off = None, None, None
        if self.invariance_every_n_steps is not None:
            self._start_probe(model, kwargs.get("train_dataloader"))

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        if self.meter is None or self.meter.off_reason or self._measuring is not None:
            return
        step = state.global_step
        if due(step, self.every_n_steps, self._last_step) and step > self._logged:
            self._measuring = step
            self.meter.start()

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        if self._measuring is not None:
            step, self._measuring = self._measuring, None
            self.meter.stop()
            result = self.meter.result(dist, label=f"step {step}")
            if result is not None:
                self.last_result = result
                self._report(result.metrics(positions=self._logged < 0), args, state, control)
                self._logged = step
        every = self.invariance_every_n_steps
        if every is not None and state.global_step % every == 0:
            self._run_probe(args, state, control, sweep=False)

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is not None:
            self.meter.abort()
        self._measuring = None
        if self.invariance_every_n_steps is not None:  # the last point, with the scale sweep
            self._run_probe(args, state, control, sweep=True)

    # -- the invariance probe ----------------------------------------------------------

    def _start_probe(self, model, train_loader) -> None:
        if not self._main:
            return  # the main process probes, alone
        if sharded(model):
            self._invariance_off("the model is sharded (FSDP), and this door probes only unsharded models")
            return
        batch = None
        if self.trainer.eval_dataset is not None:
            batch = first_samples(self.trainer.get_eval_dataloader(), self.probe_size)
        if batch is None:
            batch = first_samples(train_loader, self.probe_size)
            if batch is None:
                self._invariance_off("there is no eval or training data to take probe rows from")
                return
            self._warn("train-probe", "LNMonitorCallback: no eval dataset to take held-out probe rows "
                                      "from, so the invariance probe runs on the first training rows.")
        device = next(model.parameters()).device
        self._probe = map_tensors(probe_batch(batch, self.probe_size), lambda t: t.to(device))
        norms = choose_norms(model, None, None, self.final_norm, "LNMonitorCallback", self._warn)
        self._prober = InvarianceProbe(model, default_loss, final_norm=self.final_norm, norms=norms,
                                       autocast=self.trainer.autocast_smart_context_manager)

    def _run_probe(self, args, state, control, *, sweep: bool) -> None:
        step = state.global_step
        add_sweep = sweep and self._prober is not None and self._prober.sweep_missing(step)
        if self._prober is None or (step <= self._probed and not add_sweep):
            return
        self._probed = step
        try:
            _, metrics = self._prober.point(self._probe, step, sweep=sweep)
        except NonFiniteLoss as err:  # this point only
            self._warn("nan-loss", f"LNMonitorCallback: no invariance at step {state.global_step}: {err}.")
            return
        except Exception as err:  # noqa: BLE001 - never stop the user's training
            self._prober = None
            self._invariance_off(
                f"{type(err).__name__}: {err}. If the model needs another final norm, pass final_norm='...'; "
                "the probe's loss is model(**batch).loss, so the probe rows need labels")
            return
        self._report(metrics, args, state, control)

    def _invariance_off(self, reason: str) -> None:
        self.invariance_off = reason
        self._warn("invariance-off", f"LNMonitorCallback: the invariance probe is off for this run: {reason}")

    # -- reporting ---------------------------------------------------------------------

    def _report(self, metrics: dict[str, float], args, state, control) -> None:
        """To every ``report_to`` integration of the Trainer, from the main process."""
        if not self._main or not metrics:
            return
        self._kept.add(state.global_step, metrics)
        for reporter in list(self._reporters):
            try:
                reporter.on_log(args, state, control, logs=dict(metrics))
            except Exception as err:  # noqa: BLE001 - a reporter must never stop training
                self._reporters.remove(reporter)
                self._warn(f"report-{type(reporter).__name__}",
                           f"LNMonitorCallback: {type(reporter).__name__} failed ({err!r}); nothing more "
                           "goes to it (training goes on).")


def _logging_steps(value: float, max_steps: int) -> int:
    """The Trainer's ``logging_steps`` as a number of steps (a value below 1 is a ratio of
    ``max_steps``)."""
    if 0 < value < 1:
        return max(math.ceil(value * max_steps), 1)
    return max(int(value), 1)
