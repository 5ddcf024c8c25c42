"""The plain-PyTorch integration: :class:`LoopMonitor`, the meter and the invariance probe in a training loop
of your own (nanoGPT's ``train.py``, torchtitan, a Fabric loop, a notebook), logging the metric names of the
Lightning callbacks.  No Lightning is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch.distributed as dist
from torch import nn

from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.invariance.probe_rows import map_tensors, probe_batch
from lnmonitor.core.invariance.runs import FSDP1_REFUSED, LOSS_FN_ADVICE
from lnmonitor.core.monitor import arguments
from lnmonitor.core.monitor.monitor import Monitor, MonitorAttributes
from lnmonitor.core.monitor.settings import Settings
from lnmonitor.core.monitor.shared import Messages, guarded
from lnmonitor.core.norms.discovery import NormSelectionError
from lnmonitor.core.output.metric_names import INVARIANCE_LAYOUT, LADDER_LAYOUT
from lnmonitor.core.output.writers import metric_writer
from lnmonitor.core.wrappers import fsdp1, sharded
from lnmonitor.views.run_views import RunViews

__all__ = ["LoopMonitor"]


class LoopMonitor(MonitorAttributes):
    r"""Measure a model's norms on every ``every_n_steps``-th optimizer step of a plain loop.

    Call :meth:`start` before a step's forward and backward passes (all its micro-batches) and :meth:`stop`
    after them, before the optimizer's update, or wrap them in :meth:`step`; hooks exist only inside a
    measured step, whose numbers are merged across ``torch.distributed`` processes and written when it ends.
    With ``probe_batch`` the final-norm invariance probe runs at :meth:`start` of every
    ``invariance_every_n_steps``-th step and, with its scale sweep, at the end: the last step's :meth:`stop`
    (with ``max_steps``) or :meth:`close`, which also give the ladder over training and the summary.

    Args:
        model: the module you call: the model, or Fabric's, DDP's, DeepSpeed's engine or ``torch.compile``'s
            wrapper of it; norms are named as the model inside names them.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (one event per step, the custom-scalars layout,
            the pictures ``lnmonitor/ladder`` and ``lnmonitor/ladder_over_training``), a function
            ``write(metrics, step)``, or None (keep them in :attr:`history` only).
        settings: a :class:`~lnmonitor.core.monitor.settings.Settings` (``every_n_steps`` defaults to 50
            here), or its fields as keyword arguments.  ``on_finding`` returning True sets
            :attr:`should_stop`; ``loss_blowup`` reads the losses handed to :meth:`add_loss`.
        max_steps: the number of optimizer steps (indices ``0 .. max_steps - 1``), when known: the last is
            measured too, and ends the run (nanoGPT: ``max_steps=max_iters + 1``).
        probe_batch: held-out rows for the invariance probe, as ``loss_fn`` takes them; None: no probe
            (said once).
        loss_fn: ``loss_fn(model, batch)`` returning the loss or ``(logits, loss)``; default
            ``model(*batch)`` (``model(**batch)`` for a dict) returning a loss, ``(logits, loss)`` or an
            output with ``loss``.  Enter your autocast context in it to probe at your training precision.

    Raises:
        lnmonitor.core.monitor.arguments.ArgumentError: an argument of the wrong type or range.
        lnmonitor.core.norms.discovery.NormSelectionError: the model has no norm it can measure as asked.
        TypeError: ``writer`` is neither a SummaryWriter nor a function.

    Example::

        >>> import torch
        >>> from lnmonitor.integrations.loop import LoopMonitor
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> monitor = LoopMonitor(model, every_n_steps=1, invariance_every_n_steps=None)
        >>> with monitor.step(0):
        ...     model(torch.randn(4, 8)).pow(2).sum().backward()
        >>> monitor.history[0]["step"], "lnmonitor/sigma/1" in monitor.history[0]
        (0, True)

    To resume a run, save :meth:`state_dict` with your checkpoint and give it to :meth:`load_state_dict`.
    Notes are said on rank zero (:class:`~lnmonitor.core.monitor.shared.Messages`), warnings once.  A writer
    that raises is said once and dropped; a failing probe is turned off (:attr:`invariance_off_reason`).
    :meth:`start`, :meth:`stop` and :meth:`close` run inside :func:`~lnmonitor.core.monitor.shared.guarded`:
    an exception there turns the monitor off with one warning (:attr:`off_reason`), and the loop goes on.
    """

    configuration_errors = (arguments.ArgumentError, NormSelectionError)

    def __init__(self, model: nn.Module, writer=None, *, settings: Settings | None = None,
                 max_steps: int | None = None, probe_batch=None, loss_fn: Callable | None = None,
                 **fields) -> None:
        self.settings = Settings.build(settings, fields, "LoopMonitor")
        self.max_steps = arguments.positive_int(max_steps, "max_steps")
        loss_fn = arguments.function(loss_fn, "loss_fn", "loss_fn(model, batch) -> loss or (logits, loss)")
        every = self.settings.invariance_every_n_steps
        probed = probe_batch is not None and every is not None
        layout = {**LADDER_LAYOUT, **INVARIANCE_LAYOUT} if probed else LADDER_LAYOUT
        self._write: Callable | None = metric_writer(writer, layout)
        self._write_image = _image_writer(writer) if self.settings.images else None
        self.name = "LoopMonitor"
        self.messages = Messages(speaks=_rank_zero())
        self.monitor = Monitor(self.settings, self.name, self.messages, RunViews, advice=LOSS_FN_ADVICE)
        self.findings = self.monitor.findings
        self.should_stop = False  # on_finding asked to stop
        self.off_reason: str | None = None
        self.monitor.history.reset(receivers=writer is not None)
        self._runs = self.monitor.runs
        last = self.max_steps - 1 if self.max_steps else None
        self.meter = self.monitor.begin(model, self._emit, speaks=_rank_zero, last_step=last)
        self._started: int | None = None  # the last step given to start()
        self._ended = False
        self._every_rank = False  # a sharded model's probe forward is a collective: every rank runs it
        if every is not None:
            self._start_probe(probe_batch, loss_fn)

    def state_dict(self) -> dict:
        """What a resumed run needs: the last step logged, the findings raised and the start they judge
        growth from, the last probe run."""
        return {**self.monitor.state_dict(), "invariance_last_step": self._runs.last_step}

    def load_state_dict(self, state: dict) -> None:
        """Resume the run :meth:`state_dict` saved (no step logged or finding raised twice); TypeError for
        anything but that dict."""
        if not isinstance(state, Mapping):
            raise TypeError(f"LoopMonitor.load_state_dict takes the dict LoopMonitor.state_dict() returned, "
                            f"got {type(state).__name__}")
        self.monitor.load_state_dict(state)
        self._runs.last_step = int(state.get("invariance_last_step", -1))

    @guarded
    def start(self, step: int) -> bool:
        """Step ``step`` begins (before its forward): the probe runs if due, the norms are hooked if the step
        is measured; True when it is."""
        if self.monitor.measuring is not None:
            return False
        self._started = step
        self._probe_point(step)
        return self.monitor.start(step)

    @guarded
    def stop(self) -> dict[str, float] | None:
        """Unhook, merge across processes and write the step's metrics (rank zero); returns them, or None
        when the step was not measured.  Every process must call it.  The last step (``max_steps``) ends
        the run (see :meth:`close`)."""
        if self._started is None:
            return None
        metrics = self.monitor.end_step(self._started, self._stop_run, write_image=self._write_image)
        if self.max_steps and self._started == self.max_steps - 1:
            self._end(self._started)
        return metrics

    @guarded
    def add_loss(self, loss) -> None:
        """A micro-batch's training loss (a 0-dim tensor or a number, read at the step's end without a host
        sync) for the findings' loss rule (``loss_blowup``).  Call it on every process or on none."""
        self.monitor.add_loss(loss)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Measure the forward and backward passes inside the block if ``step`` is due."""
        self.start(step)
        try:
            yield
        except BaseException:
            self.abort()
            raise
        self.stop()

    @guarded
    def abort(self) -> None:
        """End a measured step without its numbers (the loop's step raised): no hook of the step is left
        (the every-step growth's stay until :meth:`close`)."""
        self.monitor.measuring = None
        self.meter.abort()

    @guarded
    def close(self) -> None:
        """End the run after the last update (once; nothing when ``max_steps`` ended it): the probe run
        with its scale sweep, the ladder over training and the summary.  A step still open is dropped."""
        self.detach()
        if self._started is not None:
            self._end(self._started + 1)

    def _stop_run(self) -> None:
        """``on_finding`` asked to stop: the loop reads :attr:`should_stop`."""
        self.should_stop = True

    def _end(self, step: int) -> None:
        """The probe run of ``step`` with its sweep, the heatmap and the summary (once)."""
        if self._ended:
            return
        self._ended = True
        self._probe_point(step, end=True)
        self.monitor.end(self._write_image)

    def _emit(self, step: int, metrics: dict[str, float], result=None) -> bool:
        """Keep and write ``metrics`` of ``step`` (rank zero; True on every rank: each has them merged)."""
        if not _rank_zero():
            return True
        self.monitor.history.add(step, metrics)
        if self._write is not None:
            try:
                self._write(metrics, step)
            except Exception as err:  # noqa: BLE001 - the user's writer must not stop training
                self._write = None
                self.messages.warn("writer", f"LoopMonitor: the writer failed ({err!r}); nothing more is "
                                             "written (training goes on)")
        return True

    def _start_probe(self, batch, loss_fn: Callable | None) -> None:
        """The probe of the user's model on the first ``probe_size`` rows of ``batch``, on rank zero alone;
        a sharded model (FSDP2, tensor parallelism) by every rank on rank zero's rows."""
        model = self.meter.model
        if batch is None:
            self.messages.info("LoopMonitor: no probe_batch=, so the final-norm invariance probe does not "
                               "run; pass held-out rows (probe_batch=(x, y), or a dict of the model's "
                               "inputs) to have it.")
            return
        if fsdp1(model):
            self._runs.off(FSDP1_REFUSED)
            return
        rows = probe_batch(batch, self.settings.probe_size)
        self._every_rank = sharded(model) and dist.is_available() and dist.is_initialized()
        if self._every_rank:
            rows = _from_rank_zero(rows)
        device = next(model.parameters()).device
        s = self.settings
        probe = InvarianceProbe(model, loss_fn, final_norm=s.final_norm, cases=s.cases, scales=s.scales,
                                meter=self.meter)
        self._runs.begin(probe, map_tensors(rows, lambda t: t.to(device)))

    def _probe_point(self, step: int, *, end: bool = False) -> None:
        """The probe run of ``step`` when due, on rank zero (every rank of a sharded model)."""
        if self._every_rank or _rank_zero():
            self.monitor.probe(step, self._emit, end=end)


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _from_rank_zero(rows):
    """Rank zero's probe rows on every rank (on the CPU; a collective)."""
    box = [map_tensors(rows, lambda t: t.detach().cpu()) if _rank_zero() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _image_writer(writer):
    """``write(tag, image, step)`` into ``writer``'s ``add_image`` (a ``SummaryWriter``), or None."""
    if not hasattr(writer, "add_image"):
        return None
    return lambda tag, image, step: writer.add_image(tag, image, step, dataformats="HWC")
