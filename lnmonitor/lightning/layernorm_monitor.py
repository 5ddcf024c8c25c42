"""The Lightning callback watching every normalisation layer's 1/sigma ladder and dead-plane share."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.meter.row_stats import RowStats
from lnmonitor.core.monitor import arguments
from lnmonitor.core.monitor.monitor import Monitor
from lnmonitor.core.monitor.settings import Settings
from lnmonitor.core.monitor.shared import guarded
from lnmonitor.core.norms.find import NormInfo
from lnmonitor.core.norms.roles import expected_final
from lnmonitor.core.output.metric_names import LADDER_LAYOUT
from lnmonitor.lightning.base import MonitorCallback, misconfiguration
from lnmonitor.views.hparams_session import columns_message, monitor_columns
from lnmonitor.views.run_views import RunViews

__all__ = ["LayerNormMonitor"]


class LayerNormMonitor(MonitorCallback):
    r"""Watch every normalisation layer's 1/sigma ladder and dead-plane share.

    The Lightning callback of :class:`~lnmonitor.core.meter.meter.LadderMeter`.  Every ``every_n_steps``
    optimizer steps and at the fit's last step (when the Trainer knows it) the selected norms are hooked for
    the whole step, over every row (token) of the global batch: all micro-batches and, under DDP, all ranks;
    on other steps no hook is registered.  Per row it measures, in float32, the norm's input variance ``v``
    (mean square for RMSNorm), the stream's mean square and the share of ``w = gain * dL/dy`` in the norm's
    dead subspace (span{1, xhat}, or span{xhat} for RMSNorm; docs/design.md), counted in fixed-bin
    histograms (:mod:`lnmonitor.core.meter.row_stats`: share resolved to 2.4e-4, sigma and rms to 0.39%
    relative, eps/var to 0.78%), merged across ranks and read on the host once.  Autocast, gradient
    accumulation, ``torch.compile`` (measured steps run eagerly) and activation checkpointing:
    docs/conditions.md.  A selected norm that gets no row in a measured step is named in a warning, once.

    Args:
        settings: a :class:`~lnmonitor.core.monitor.settings.Settings`, or its fields as keyword arguments.
            ``every_n_steps`` defaults to the Trainer's ``log_every_n_steps`` (gradient accumulation does
            not multiply it); ``loss_blowup`` reads the loss ``training_step`` returns; ``on_finding``
            returning True stops the fit (``trainer.should_stop``).
        histograms: also write TensorBoard histograms of the per-row share and sigma.

    Raises:
        MisconfigurationException: in ``__init__`` for an argument of the wrong type or range; when the fit
            starts, if the model has no normalisation layer, the patterns select none, ``final_norm`` is not
            a selected norm, or a selected norm is too narrow for its dead subspace.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lnmonitor import LayerNormMonitor
        >>> monitor = LayerNormMonitor(every_n_steps=10)
        >>> trainer = Trainer(callbacks=[monitor])

    Logged metrics (``<norm>`` is the norm's qualified name in the LightningModule, e.g.
    ``model.blocks.0.ln1``; all are over the rows of one measured step):

    ==========================================  ==============================================================
    ``lnmonitor/sigma/<norm>``                  median ``sqrt(v + eps)`` of the input rows (input units)
    ``lnmonitor/inv_sigma/<norm>``              ``1 / sigma``: the norm's gain on the residual stream
                                                (1 / input units); the ladder
    ``lnmonitor/rms/<norm>``                    median ``sqrt(mean(x^2))`` of the stream the norm reads
                                                (input units)
    ``lnmonitor/eps_over_var/<norm>``           median ``eps / v`` (dimensionless)
    ``lnmonitor/transmission/<norm>``           median ``eps / (v + eps)``: the fraction the Jacobian passes
                                                along the scale direction
    ``lnmonitor/log10_eps_over_var/<norm>``     ``log10`` of the median ``eps / v`` (these two span decades:
    ``lnmonitor/log10_transmission/<norm>``     read them on this scale)
    ``lnmonitor/share_median/<norm>``           median dead-plane share ``|P w| / |w|`` (0..1)
    ``lnmonitor/share_p90/<norm>``              its 90th percentile
    ``lnmonitor/share_max/<norm>``              its exact maximum
    ``lnmonitor/skipped_rows/<norm>``           rows without a share that are faults (non-finite gradient or
                                                input, constant row), count: 0 on a healthy run
    ``lnmonitor/zero_grad_rows/<norm>``         rows with no gradient (zero or rounding-level, finite input)
                                                where their position has no target (label -100, a causal
                                                LM's last token), count
    ``lnmonitor/share_baseline/median``         median share of a random direction for this width and
                                                dead-subspace dimension
    ``lnmonitor/share_baseline/max``            median of the max of as many random rows as were measured
                                                (compare with ``share_max``)
    ``lnmonitor/ladder/attenuation``            ``inv_sigma(first rung) / inv_sigma(last rung)``
    ``lnmonitor/ladder/growth``                 ``rms(last rung) / rms(first rung)``
    ``lnmonitor/ladder/<stack>/attenuation``,   the same over another stack's ladder (an encoder-decoder's
    ``lnmonitor/ladder/<stack>/growth``         encoder, ``model.encoder``)
    ``lnmonitor/ladder_position/<norm>``        the norm's place among the rungs in forward order (0 first),
                                                -1 for a norm that is not a rung; logged at the first
                                                measured step of each fit (a resumed fit's log has them too)
    ==========================================  ==============================================================

    With ``images=True`` also the pictures ``lnmonitor/ladder`` (at measured steps ``image_every_n_steps``
    apart, and the last) and ``lnmonitor/ladder_over_training`` (at the end of the fit).  When the selected
    norms differ in width or kind, the baselines are per norm: ``lnmonitor/share_baseline/median/<norm>`` and
    ``.../max/<norm>``.  With a TensorBoard logger: a custom-scalars layout (the whole ladder, the shares
    against their baselines), the norm kind, eps and width in the HPARAMS tab, and with ``histograms=True``
    ``lnmonitor/hist/share/<norm>`` and ``lnmonitor/hist/sigma/<norm>``.
    """

    def __init__(self, settings: Settings | None = None, *, histograms: bool = False, **fields) -> None:
        with misconfiguration():
            self.settings = Settings.build(settings, fields, "LayerNormMonitor")
            self.histograms = arguments.flag(histograms, "histograms")
        super().__init__(self.settings.keep_history)
        self._loggers.histograms = self.histograms
        self.monitor = Monitor(self.settings, self.name, self.messages, RunViews)
        self.findings = self.monitor.findings
        self.meter: LadderMeter | None = None
        self.last_row_stats: list[RowStats] = []
        self._stepping: int | None = None  # the optimizer step whose batches are running
        self._columns: str | None = None  # the norm the HPARAMS columns name, until a step checks it
        self._loggers.add_layout(LADDER_LAYOUT)  # written to each logger with the fit's first log there

    @property
    def every_n_steps(self) -> int | None:
        """The cadence of this fit (the settings', else the Trainer's ``log_every_n_steps``)."""
        return self.monitor.every_n_steps

    @property
    def norms(self) -> list[NormInfo]:
        """The measured norms (with their roles once the first step has assigned them)."""
        return self.meter.norms if self.meter is not None else []

    @property
    def order(self) -> list[str]:
        """The norms' names in the order the forward first ran them."""
        return self.meter.order if self.meter is not None and self.meter.order else self.monitor.order

    @property
    def state_key(self) -> str:
        s = self.settings
        return self._generate_state_key(every_n_steps=s.every_n_steps, include=s.include, exclude=s.exclude)

    @override
    @guarded(starts_run=True)
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.monitor.reset()  # each kind is raised once per fit (a resumed fit's come back next)
        self.meter, self.last_row_stats, self._stepping = None, [], None
        self._loggers.setup(trainer, hparams=True)

    @override
    @guarded
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After configure_model and the strategy's setup: the model is complete and sharded.
        last = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        with misconfiguration():
            self.meter = self.monitor.begin(pl_module, functools.partial(self._loggers.log, trainer),
                                            speaks=lambda: trainer.is_global_zero,
                                            every_n_steps=max(int(trainer.log_every_n_steps), 1),
                                            last_step=int(last) - 1 if math.isfinite(last) else None)
        # TensorBoard keeps the session written now, before a step found the roles: its columns name the
        # final norm the meter's rule expects from what is known (checked at the first step)
        by_name = {n.name: n for n in self.meter.norms}
        self._columns = expected_final([by_name[n] for n in self.meter.forward_order()], self.settings.ladder,
                                       self.settings.final_norm)
        dtype = next((p.dtype for p in pl_module.parameters() if p.is_floating_point()), torch.float32)
        columns = monitor_columns(self.norms, dtype, self.every_n_steps, self._columns)
        if not self._loggers.give_hparams(trainer, pl_module, *columns):
            self._columns = None

    @override
    @guarded
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.detach()

    @override
    @guarded
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.detach()

    @override
    @guarded
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.detach()
        self.monitor.end(self._image_writer(trainer))

    def detach(self) -> None:
        """End the fit's measuring (an exception, the end of the fit): no hook, no row left."""
        self.monitor.close()
        self._stepping = None

    @override
    @guarded
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.meter is None or self.meter.off_reason:
            return
        if self._stepping is None:
            self._stepping = trainer.global_step
        self.monitor.start(trainer.global_step)
        self.monitor.use_batch(batch)  # each micro-batch's padding

    @override
    @guarded
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._stepping is None:
            return
        self.monitor.add_loss(outputs.get("loss") if isinstance(outputs, Mapping) else outputs)
        if trainer.global_step == self._stepping:
            return  # still accumulating gradients for this step
        step, self._stepping = self._stepping, None
        first = self.monitor.positions  # the fit's first logged measured step: the roles are known
        stop = lambda: setattr(trainer, "should_stop", True)  # noqa: E731
        metrics = self.monitor.end_step(step, stop, counts=self.histograms, label=f"the measured step {step}",
                                        write_image=self._image_writer(trainer))
        if metrics is not None:
            self.last_row_stats = self.monitor.last_result.row_stats
            if first:  # say once when the HPARAMS columns named another final norm than the step found
                named, self._columns = self._columns, None
                final = self.monitor.last_result.figures.final
                if named is not None and named != final:
                    self.messages.warn("columns", columns_message("LayerNormMonitor", named, final))

    def _image_writer(self, trainer: Trainer):
        return lambda tag, image, step: self._loggers.log_image(trainer, tag, step, image)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.monitor.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.monitor.load_state_dict(state_dict)
