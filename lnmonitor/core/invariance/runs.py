"""The invariance probe's runs at training steps: one rule for every monitor.

Each monitor decides *when* a probe run is due and *where* its numbers go; :class:`InvarianceRuns` does the
run: a step already probed is not probed again unless its sweep is asked for and missing, a non-finite loss
is said once and the next step is tried, a sweep without a slope is noted once on the ``lnmonitor`` logger,
and a probe that cannot run on this model turns the probe off with its cause and location.
"""

from __future__ import annotations

import logging
import math

from lnmonitor.core.invariance.loss_contract import default_loss
from lnmonitor.core.invariance.probe import InvarianceProbe, NonFiniteLoss
from lnmonitor.core.invariance.results import InvarianceResult
from lnmonitor.core.monitor.shared import Messages, off_message, where

__all__ = ["FSDP1_REFUSED", "LOSS_FN_ADVICE", "SHARDED_REFUSED", "InvarianceRuns"]

_log = logging.getLogger("lnmonitor")

# what a monitor with a ``loss_fn=`` argument adds when its default call of the model failed
LOSS_FN_ADVICE = (
    "The probe called the model with the batch (model(*batch), model(**batch) for a dict) and read "
    "the loss or (logits, loss) it returned; if your model takes its inputs otherwise (LitGPT's "
    "GPT(x, y) reads y as input_pos), pass loss_fn=lambda model, batch: <the loss or (logits, loss)>, "
    "e.g. torch.nn.functional.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())."
)

# why a monitor's probe is off for an FSDP1 model (core.wrappers.fsdp1)
FSDP1_REFUSED = ("the model holds FSDP1 units (FullyShardedDataParallel, as Lightning's and Fabric's "
                 "FSDPStrategy wrap it), which gather their weights only inside the wrapper's forward, and "
                 "the probe's passes call the model itself; the ladder is not affected. Shard with FSDP2 "
                 "(fully_shard, Lightning's ModelParallelStrategy) or use DDP to probe the final norm.")

# why the transformers.Trainer callback's probe is off for a sharded model (core.wrappers.sharded)
SHARDED_REFUSED = ("the model's parameters are sharded over the processes (FSDP, DeepSpeed ZeRO-3), so "
                   "its forward is a collective every process must join, and this callback probes on the "
                   "main process alone; the ladder is not affected. To probe the final norm, train with "
                   "DDP or DeepSpeed ZeRO-2, or use LoopMonitor (lnmonitor.integrations.loop), which "
                   "probes a sharded model on every process.")


class InvarianceRuns:
    """The probe runs of ``prober`` on ``batch`` during one training run (:meth:`begin`), each taken by
    :meth:`take`; ``name`` starts the messages ``messages`` says; ``on_off(reason)``, when given, is called
    instead of the message when the probe turns off; ``advice`` (:data:`LOSS_FN_ADVICE` for a monitor with a
    ``loss_fn=`` argument) ends that message when the probe failed running the default loss. ``off_reason``:
    why the probe is off (None while on); ``last_step``: the step probed last (-1: none; a monitor resuming
    sets it); ``last``: the last run's :class:`~lnmonitor.core.invariance.results.InvarianceResult`."""

    def __init__(self, name: str, messages: Messages, on_off=None, advice: str = "") -> None:
        self.name = name
        self.messages = messages
        self.advice = advice
        self._on_off = on_off  # a monitor whose probe is the monitor itself turns itself off (and says so)
        self.begin(None, None)

    def begin(self, prober: InvarianceProbe | None, batch) -> None:
        """A new run: probe ``batch`` with ``prober`` (None: the probe does not run)."""
        self.prober, self.batch = prober, batch
        self.off_reason: str | None = None
        self.last_step = -1
        self.last: InvarianceResult | None = None
        self._no_fit_noted = False

    def off(self, reason: str) -> None:
        """Turn the probe off for the rest of the run, saying why once (or ``on_off(reason)``)."""
        self.prober, self.off_reason = None, reason
        if self._on_off is not None:
            self._on_off(reason)
            return
        self.messages.warn("invariance-off", off_message(f"{self.name}: the invariance probe", reason))

    def wanted(self, step: int, *, sweep: bool) -> bool:
        """Whether :meth:`take` would probe ``step`` (its sweep too with ``sweep``)."""
        if self.prober is None:
            return False
        return step > self.last_step or (sweep and self.prober.sweep_missing(step))

    def take(self, step: int, *, sweep: bool) -> tuple[dict[str, float], bool] | None:
        """The probe run of ``step`` (the sweep too with ``sweep``): its new finite metrics and whether they
        extend the step probed last (its sweep added to it); None when nothing was taken."""
        if not self.wanted(step, sweep=sweep):
            return None
        extend = step == self.last_step
        self.last_step = step
        try:
            result, metrics = self.prober.point(self.batch, step, sweep=sweep)
        except NonFiniteLoss as err:  # this step only: a later one may be finite again
            self.messages.warn("nan-loss", f"{self.name}: no invariance point at step {step}: {err}. Said "
                                           "once; the next point is probed again.")
            return None
        except Exception as err:  # noqa: BLE001 - the probe's failure stops the probe, not the training
            advice = f" {self.advice}" if self.advice and self.prober.loss_fn is default_loss else ""
            self.off(f"{type(err).__name__}: {err} (raised at {where(err)}).{advice}")
            return None
        self.last = result
        if sweep and result.sweep and not math.isfinite(result.slope) and not self._no_fit_noted:
            self._no_fit_noted = True  # a note, not a warning: the reason stays in last_result.fit_note
            _log.info("%s: no scale-sweep slope at step %d: %s. Noted once.", self.name, step,
                      result.fit_note)
        return metrics, extend
