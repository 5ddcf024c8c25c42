"""The Lightning callback checking that the loss ignores shifts and scales of the final norm's input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.invariance.probe_rows import first_samples, map_tensors, pad_id_of, probe_batch
from lnmonitor.core.invariance.results import InvarianceResult
from lnmonitor.core.invariance.runs import FSDP1_REFUSED, InvarianceRuns
from lnmonitor.core.monitor import arguments
from lnmonitor.core.monitor.settings import Settings
from lnmonitor.core.monitor.shared import due, guarded, off_message
from lnmonitor.core.norms.discovery import choose_norms, measured_eps_message
from lnmonitor.core.norms.find import NormInfo
from lnmonitor.core.output.metric_names import INVARIANCE_LAYOUT, invariance_metric, run_metric
from lnmonitor.core.wrappers import fsdp1, sharded
from lnmonitor.lightning.base import MonitorCallback, misconfiguration
from lnmonitor.lightning.layernorm_monitor import LayerNormMonitor
from lnmonitor.lightning.probe_loss import probe_loss
from lnmonitor.views.summary import invariance_summary

__all__ = ["FinalNormInvarianceMonitor"]

# the settings this callback reads (lnmonitor.Settings): the probe's
READS = ("invariance_every_n_steps", "probe_size", "final_norm", "cases", "scales", "summary", "keep_history")


class FinalNormInvarianceMonitor(MonitorCallback):
    r"""Check that the loss ignores shifts and scales of the final norm's input.

    The Lightning callback of :class:`~lnmonitor.core.invariance.probe.InvarianceProbe`.  On a fixed held-out
    probe batch it runs the five cases of docs/design.md (one forward pass of the probe rows; the others
    replay what ran before the final norm) at the step indices that are multiples of
    ``invariance_every_n_steps`` (taken as soon as the previous update is done, so that a checkpoint saved
    then records it; the point after the last update included) and, with ``on_validation=True``, after each
    validation (not the sanity check; a step already probed is reused).  The scale sweep (8 scales, 7 more
    passes) runs at the end of the fit, after validations with ``on_validation=True`` and every
    ``sweep_every_n_steps``.  The final norm sees the transformed input in float64 (the shift cases are
    exactly zero for a LayerNorm); train/eval mode and the RNG state are restored.  Only rank zero computes,
    except for a sharded model (FSDP2, tensor parallelism): all ranks probe rank zero's batch and rank zero
    logs (FSDP1 is refused, said once: :data:`~lnmonitor.core.invariance.runs.FSDP1_REFUSED`); a compiled
    model is probed eagerly.

    Before its first run one gradient pass checks that the final norm's input reaches the loss only through
    the norm (:func:`~lnmonitor.core.invariance.final_norm.final_norm_bypass`); when it does not (no final
    norm: the last norm sits inside a block) the cases would read zero falsely, so the monitor warns, sets
    ``off_reason`` and logs nothing.  Any error while probing also turns it off with a warning.

    Args:
        settings: a :class:`~lnmonitor.core.monitor.settings.Settings`, of which it reads
            ``invariance_every_n_steps``, ``probe_size``, ``final_norm``, ``cases``, ``scales``, ``summary``
            and ``keep_history``; or those as keyword arguments.
        on_validation: also run after each validation, the sweep included (one forward pass of the probe
            rows and 12 replayed ones; docs/performance.md has its cost).
        sweep_every_n_steps: also run the scale sweep at the points that are multiples of this (a multiple
            of ``invariance_every_n_steps``, or it never coincides); ``None``: only as said above.
        probe_batch: the batch to probe (anything ``loss_fn`` accepts).  ``None``: the first ``probe_size``
            samples of the validation data the Trainer uses (as many batches as it takes), else the first
            training batch (with a warning: it is not held out).
        loss_fn: ``loss_fn(module, batch)`` returning the loss or ``(logits, loss)``; ``None``: see
            :mod:`lnmonitor.lightning.probe_loss` (``module(*batch)`` when it returns a loss, else the loss
            ``training_step(batch, 0)`` returns, under automatic optimisation).

    Raises:
        MisconfigurationException: in ``__init__`` for an argument of the wrong type or range, or when it
            would never run; when the fit starts, if the model has no normalisation layer or ``final_norm``
            is not one.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lnmonitor import FinalNormInvarianceMonitor
        >>> monitor = FinalNormInvarianceMonitor(invariance_every_n_steps=500)
        >>> trainer = Trainer(callbacks=[monitor])

    Logged metrics (``<case>`` in ``shift_5``, ``shift_1000``, ``scale_3``, ``scale_3_shift_5``, ``axis_5``):

    ================================================  ====================================================
    ``lnmonitor/invariance/<case>/dloss``             loss(transformed) - loss (nats); zero for the shifts,
                                                      eps-sized for the scales, clearly non-zero for
                                                      ``axis_5``
    ``lnmonitor/invariance/<case>/log10_abs_dloss``   ``log10 |dloss|``, readable across the decades
                                                      between the cases (none when dloss is exactly 0)
    ``lnmonitor/invariance/<case>/max_dlogit``        max |delta logit| (logit units), when the forward
                                                      returns logits
    ``lnmonitor/invariance/<case>/out_residual``      median over rows of ``|xhat(Th) - xhat(h)| /
                                                      |xhat(h)|`` in float64 (= ``|a sigma/sigma_a - 1|``)
    ``lnmonitor/invariance/scale_slope``              slope of log|dloss| vs log(eps/v) over the sweep
                                                      points with 1e-5 < eps/v < 10
    ``lnmonitor/invariance/scale_constant``           exp(intercept) of that fit (nats)
    ``lnmonitor/invariance/scale_rounding_points``    sweep points with eps/v <= 1e-5 whose loss moved:
                                                      float32 rounding, not eps
    ================================================  ====================================================

    The three ``scale_*`` metrics come with the sweep.  The latest run's full result (per-scale points
    included) is ``last_result``.
    """

    advice = ("If it was raised by your training_step or forward running the probe batch, "
              "loss_fn=lambda module, batch: ... chooses the loss the probe runs.")

    def __init__(self, settings: Settings | None = None, *, on_validation: bool = False,
                 sweep_every_n_steps: int | None = None, probe_batch: Any = None,
                 loss_fn: Callable[[LightningModule, Any], Any] | None = None, **fields) -> None:
        with misconfiguration():
            self.settings = Settings.build(settings, fields, "FinalNormInvarianceMonitor", READS)
            self.on_validation = arguments.flag(on_validation, "on_validation")
            if self.settings.invariance_every_n_steps is None and not self.on_validation:
                raise MisconfigurationException(
                    "FinalNormInvarianceMonitor would never run: set invariance_every_n_steps to a positive "
                    "integer or on_validation=True")
            self.sweep_every_n_steps = arguments.positive_int(sweep_every_n_steps, "sweep_every_n_steps")
            self.loss_fn = arguments.function(loss_fn, "loss_fn",
                                              "loss_fn(module, batch) -> loss or (logits, loss)")
        self.probe_batch = probe_batch
        s = self.settings
        self.invariance_every_n_steps, self.probe_size = s.invariance_every_n_steps, s.probe_size
        self.final_norm = s.final_norm
        self.cases, self.scales, self.summary = s.cases, s.scales, s.summary
        super().__init__(s.keep_history)
        self._loggers.add_layout(INVARIANCE_LAYOUT)  # written to each logger with the fit's first log there
        self._reset()

    def _reset(self) -> None:
        """Forget everything about the last fit (a reused callback starts afresh)."""
        self.last_result: InvarianceResult | None = None
        self.off_reason = None
        self._norms: list[NormInfo] = []
        self._probe: Any = None
        self._first_train_batch: Any = None
        self._prober: InvarianceProbe | None = None
        self._runs = InvarianceRuns(self.name, self.messages, on_off=self._disable)
        self._sharded = False
        self._final_name: str | None = self.final_norm
        self._enabled = False

    @property
    def state_key(self) -> str:
        # the key's name is the one older checkpoints saved it under
        return self._generate_state_key(every_n_steps=self.invariance_every_n_steps, cases=self.cases)

    @override
    @guarded(starts_run=True)
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._reset()
        self._loggers.setup(trainer, hparams=stage == "fit")

    @override
    @guarded
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(pl_module)
        metrics = [invariance_metric("log10_abs_dloss", c) for c in ("scale_3", "axis_5") if c in self.cases]
        if self.scales:
            metrics.append(invariance_metric("scale_slope"))
        params = {run_metric("final_norm"): self._final_name or "auto"}
        self._loggers.give_hparams(trainer, pl_module, params, metrics)

    @override
    @guarded
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._norms:  # trainer.validate() alone: no on_fit_start
            self._start(pl_module)

    def _start(self, pl_module: LightningModule) -> None:
        # After configure_model and the strategy's setup: the model is complete and sharded.
        with misconfiguration():
            self._norms = choose_norms(pl_module, None, None, self.final_norm, "FinalNormInvarianceMonitor",
                                       self.messages.warn)
        said = measured_eps_message("FinalNormInvarianceMonitor", self._norms)
        if said:
            self.messages.info(said)
        self._sharded = sharded(pl_module)
        if fsdp1(pl_module):  # its units gather their weights only inside the wrapper's forward
            self._disable(FSDP1_REFUSED)
            return
        self._enabled = True

    @override
    @guarded
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.invariance_every_n_steps is not None:  # the point after the last update (its sweep)
            self._run(trainer, pl_module, trainer.global_step, sweep=True)
        if self.summary and self.last_result is not None and trainer.is_global_zero:
            self.messages.info(invariance_summary(self._final_name, self._loggers.last_step,
                                                  self.last_result.metrics(), self.settings.changed()))
        if self._enabled and self._loggers.last_step < 0 and trainer.is_global_zero:
            every = self.invariance_every_n_steps
            when = f"every {every} optimizer steps" if every else ""
            if self.on_validation:
                when += (" and " if when else "") + "after each validation"
            self._loggers.warn_once("never-ran", f"FinalNormInvarianceMonitor never ran in this fit: it runs "
                                    f"{when}, and no such point came (no validation ran?). Set "
                                    "invariance_every_n_steps, or add validation data.")

    def _disable(self, reason: str) -> None:
        self._enabled = False
        self.off_reason = reason
        self._loggers.warn_once("off", off_message("FinalNormInvarianceMonitor", reason))

    @override
    @guarded
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._first_train_batch is None and self.probe_batch is None:
            self._first_train_batch = batch
        self._take_due(trainer, pl_module)  # the fit's first point (the others come at the batch's end)

    @override
    @guarded
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Step s's probe run (the weights after s updates) is taken as soon as update s is done: a checkpoint
        # saved now (ModelCheckpoint runs after the other callbacks) records it and a validation at the same
        # step reuses it, so a fit resumed from this checkpoint neither repeats nor misses it.
        self._take_due(trainer, pl_module)

    @override
    @guarded
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.on_validation and not trainer.sanity_checking:
            self._run(trainer, pl_module, trainer.global_step, sweep=True)

    def _take_due(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The probe run of the step the Trainer is at, when the cadence has one there (once)."""
        step, every, sweeps = trainer.global_step, self.invariance_every_n_steps, self.sweep_every_n_steps
        if every is not None and due(step, every):
            self._run(trainer, pl_module, step, sweep=sweeps is not None and due(step, sweeps))

    def _run(self, trainer: Trainer, pl_module: LightningModule, step: int, sweep: bool) -> None:
        """Probe ``step``, its sweep with ``sweep``, unless it was logged (with its sweep, when asked)."""
        add_sweep = sweep and self._prober is not None and self._prober.sweep_missing(step)
        if not self._enabled or (step <= self._loggers.last_step and not add_sweep):
            return
        if not trainer.is_global_zero and not self._sharded:
            self._loggers.last_step = step
            return
        probe = self._get_probe(trainer, pl_module)
        if probe is None:
            return
        runs = self._runs
        if runs.prober is None:
            runs.begin(self._prober_for(trainer, pl_module, probe), probe)
        runs.last_step = self._loggers.last_step  # a resumed fit's, from the checkpoint
        taken = runs.take(step, sweep=sweep)
        if taken is None:
            return
        metrics, extend = taken
        self._final_name = self._prober.final_norm
        self.last_result = runs.last
        self._loggers.log(trainer, step, metrics, extend=extend)

    def _prober_for(self, trainer: Trainer, pl_module: LightningModule, probe) -> InvarianceProbe:
        if self._prober is None:
            # beside a LayerNormMonitor, its meter's norms and final norm: one rule for both
            meter = next((cb.meter for cb in trainer.callbacks
                          if isinstance(cb, LayerNormMonitor) and cb.meter is not None), None)
            self._prober = InvarianceProbe(pl_module, self.loss_fn or probe_loss(pl_module, probe),
                                           final_norm=self.final_norm, cases=self.cases, scales=self.scales,
                                           autocast=trainer.precision_plugin.forward_context,
                                           norms=None if meter is not None else self._norms, meter=meter)
        return self._prober

    def _get_probe(self, trainer: Trainer, pl_module: LightningModule):
        if self._probe is not None:
            return self._probe
        batch = self.probe_batch
        if batch is None:
            batch = first_samples(
                trainer.val_dataloaders, self.probe_size, pad=pad_id_of(pl_module),
                info=lambda text: self.messages.info(f"FinalNormInvarianceMonitor: {text}."),
                warn=lambda text: self.messages.warn("probe-rows", f"FinalNormInvarianceMonitor: {text}."))
        if batch is None:
            batch = self._first_train_batch
            if batch is None:
                return None
            self._loggers.warn_once("train-probe", "FinalNormInvarianceMonitor: no validation data to take a "
                                    "held-out probe batch from, so it probes the first training batch; pass "
                                    "probe_batch=... to choose.")
        batch = probe_batch(batch, self.probe_size)
        if self._sharded:  # every rank probes the same rows: rank zero's
            batch = trainer.strategy.broadcast(map_tensors(batch, lambda t: t.cpu()), src=0)
        self._probe = trainer.strategy.batch_to_device(batch, pl_module.device)
        return self._probe

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "final_norm": self._final_name}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.final_norm is None and state_dict.get("final_norm"):
            self._final_name = state_dict["final_norm"]
