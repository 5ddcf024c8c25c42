"""The plain-PyTorch door: the meter and the invariance probe in a training loop of your own
(nanoGPT's ``train.py``, torchtitan, a Fabric loop, a notebook), in a few added lines.

:class:`LoopMonitor` decides which steps :class:`~lnmonitor.core.meter.meter.LadderMeter` measures
(every ``every_n_steps``-th and the last), merges them across ``torch.distributed``
processes when a process group is up, runs the final-norm invariance probe
(:class:`~lnmonitor.core.invariance.measure.InvarianceProbe`) on held-out rows, and writes from rank
zero to a TensorBoard ``SummaryWriter`` (scalars, the custom-scalars layout and the ladder
pictures) or a function of your own -- the metric names of the Lightning callbacks.  No
Lightning is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch.distributed as dist
from torch import nn

from lnmonitor.core.after_step import AfterStep
from lnmonitor.core.findings.reader import door_reader, reads_growth
from lnmonitor.core.hooks import fsdp1, model_class, sharded
from lnmonitor.core.invariance.points import FSDP1_REFUSED, LOSS_FN_ADVICE, InvariancePoints
from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.invariance.probe_rows import map_tensors, probe_batch
from lnmonitor.core.invariance.results import PROBE_WINDOWS, InvarianceResult
from lnmonitor.core.meter.meter import LadderResult
from lnmonitor.core.monitor import arguments
from lnmonitor.core.monitor.shared import History, Voice, due, guarded
from lnmonitor.core.norms.discovery import NormSelectionError
from lnmonitor.core.output.metric_names import INVARIANCE_LAYOUT, LADDER_LAYOUT
from lnmonitor.core.output.writers import metric_writer
from lnmonitor.core.settings import LadderSettings
from lnmonitor.views.run_views import RunViews

__all__ = ["LoopMonitor"]


class LoopMonitor:
    r"""Measure a model's norms on every ``every_n_steps``-th optimizer step of a plain loop.

    Call :meth:`start` before the forward and backward passes of a step (all its
    micro-batches) and :meth:`stop` after them, before the optimizer's update, or wrap them in
    :meth:`step`; the hooks exist only inside a measured step, and the step's numbers are
    written when it ends.  With ``probe_batch``, the final-norm invariance probe runs at
    :meth:`start` of every ``invariance_every_n_steps``-th step (the weights after that many
    updates) and, with its scale sweep, at the end.  The end is the last step's :meth:`stop`
    (with ``max_steps``) or :meth:`close`: then the sweep, the picture of the ladder over
    training and the end-of-training summary.

    Args:
        model: the module you call: the model, or Fabric's, DDP's, DeepSpeed's engine or
            ``torch.compile``'s wrapper of it; norms are named as the model inside names them.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (the metrics as one event per
            step, the custom-scalars layout, and the pictures ``lnmonitor/ladder`` and
            ``lnmonitor/ladder_over_training``), a function ``write(metrics, step)``, or None
            (keep them in :attr:`history` only).
        every_n_steps: measure the steps whose index is a multiple of this (default 50).
        max_steps: the number of optimizer steps (indices ``0 .. max_steps - 1``), when known:
            the last is measured too, and ends the run.  nanoGPT runs ``iter_num`` from 0 to
            ``max_iters`` inclusive: ``max_steps=max_iters + 1``.
        include, exclude, final_norm, ladder: as for
            :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor`.
        row_mask: which rows (tokens) to measure: None (default) leaves out the padding that
            the model's keyword inputs mark (``model(**batch)`` with an
            ``attention_mask``); ``False`` measures every row; a callable ``row_mask(inputs)``
            of the model's keyword inputs returns a bool tensor of the rows to measure.
        probe_batch: held-out rows for the invariance probe, as ``loss_fn`` takes them
            (default ``model(*batch)`` for a tuple, ``model(**batch)`` for a dict, returning
            a loss, ``(logits, loss)`` or an output with ``loss``); None: no probe (said once).
        loss_fn: ``loss_fn(model, batch)`` returning the loss or ``(logits, loss)``; enter
            your autocast context in it to probe at your training precision.
        invariance_every_n_steps: the probe's cadence in optimizer steps (default 1000; it
            also runs at the end); None: no probe.
        probe_size: the probe's rows: the first ``probe_size`` of ``probe_batch`` (default 64).
        images: write the ladder pictures to a ``SummaryWriter`` (``image_every_n_steps``
            apart, and the last) and the ladder over training at the end.
        image_every_n_steps: the least number of steps between two ladder pictures.
        summary: print the one-screen summary of the run at the end (rank zero).
        keep_history: keep every written dict in :attr:`history`; None keeps them only
            when there is no ``writer``.
        findings, on_finding: as for :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor`
            (docs/findings.md); ``on_finding`` returning True sets :attr:`should_stop`, for
            the loop to check.  The loss rule (``loss_blowup``) reads the losses handed to
            :meth:`add_loss`.

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

    Notes (the eps it measured, the rungs, the summary) are printed on rank zero, as
    Lightning prints its callbacks' (:class:`~lnmonitor.core.monitor.shared.Voice`: where logging shows
    the ``lnmonitor`` logger's INFO, they go there instead); what went wrong is a warning,
    said once.  A writer that raises is said once and dropped; a probe that fails is turned
    off with its reason (:attr:`invariance_off`).  :meth:`start`, :meth:`stop` and
    :meth:`close` run inside :func:`~lnmonitor.core.monitor.shared.guarded`: an exception there turns
    the monitor off with one warning naming the cause (:attr:`off_reason`), and the loop goes on.
    """

    refusals = (arguments.ArgumentError, NormSelectionError)

    def __init__(
        self,
        model: nn.Module,
        writer=None,
        *,
        every_n_steps: int = 50,
        max_steps: int | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        final_norm: str | None = None,
        ladder: str | Sequence[str] | None = None,
        row_mask: Callable | bool | None = None,
        probe_batch=None,
        loss_fn: Callable | None = None,
        invariance_every_n_steps: int | None = 1000,
        probe_size: int | None = PROBE_WINDOWS,
        images: bool = True,
        image_every_n_steps: int = 50,
        summary: bool = True,
        keep_history: bool | None = None,
        findings: Mapping[str, float | None] | bool | None = None,
        on_finding: Callable | None = None,
    ) -> None:
        # a plain loop has no log cadence of its own to fall back on: every_n_steps is a number
        self.every_n_steps = arguments.positive_int(every_n_steps, "every_n_steps", allow_none=False)
        self.settings = LadderSettings(
            every_n_steps=every_n_steps, include=include, exclude=exclude, final_norm=final_norm,
            ladder=ladder, row_mask=row_mask, images=images, image_every_n_steps=image_every_n_steps,
            summary=summary, keep_history=keep_history)
        self.max_steps = arguments.positive_int(max_steps, "max_steps")
        self.invariance_every_n_steps = arguments.positive_int(invariance_every_n_steps,
                                                               "invariance_every_n_steps")
        loss_fn = arguments.function(loss_fn, "loss_fn", "loss_fn(model, batch) -> loss or (logits, loss)")
        size = arguments.positive_int(probe_size, "probe_size", unit="samples")
        probed = probe_batch is not None and self.invariance_every_n_steps is not None
        layout = {**LADDER_LAYOUT, **INVARIANCE_LAYOUT} if probed else LADDER_LAYOUT
        self._write: Callable | None = metric_writer(writer, layout)
        self._write_image = _image_writer(writer) if self.settings.images else None
        self.owner = "LoopMonitor"
        self.voice = Voice(speaks=_rank_zero())
        self.findings = door_reader(findings, on_finding, lambda: self.voice.speaks, self.owner,
                                    self.voice.say)
        self.should_stop = False  # on_finding asked to stop
        self.off_reason: str | None = None
        self._kept = History(self.settings.keep_history)
        self._kept.reset(receivers=writer is not None)
        self._points = InvariancePoints(self.owner, self.voice, advice=LOSS_FN_ADVICE)
        self.meter = self.settings.meter(model, self.owner, self.voice.say, self.voice.warn,
                                         watch_growth=reads_growth(self.findings))
        views = RunViews.of(self.settings, self.owner, self.voice.say, self.voice.warn)
        self._after = AfterStep(self.meter, self.findings, views, speaks=_rank_zero, warn=self.voice.warn,
                                owner=self.owner)
        self._measuring: int | None = None
        self._started: int | None = None  # the last step given to start()
        self._ended = False
        self._every_rank = False  # a sharded model's probe forward is a collective: every rank runs it
        if self.invariance_every_n_steps is not None:
            self._start_probe(probe_batch, loss_fn, size, self.settings.final_norm)

    @property
    def invariance_off(self) -> str | None:
        """Why the invariance probe is off for this run (None while it is on, or never asked for)."""
        return self._points.off_reason

    @property
    def last_invariance(self) -> InvarianceResult | None:
        """The last invariance point's full result (its sweep points included)."""
        return self._points.last

    @property
    def last_result(self) -> LadderResult | None:
        """The last measured step's result."""
        return self._after.last_result

    @property
    def history(self) -> list[dict[str, float]]:
        """Every dict written, with its ``step`` (see ``keep_history``)."""
        return self._kept.rows

    def shut(self) -> None:
        """Remove every hook and forget the step in progress (the guard tripped, or the run ended)."""
        self._measuring = None
        self.meter.close()

    # -- one step ----------------------------------------------------------------------

    @guarded
    def start(self, step: int) -> bool:
        """Step ``step`` begins (before its forward): the invariance probe runs if it is due,
        and the norms are hooked if the step is measured; True when it is."""
        if self._measuring is not None:
            return False
        self._started = step
        if self.invariance_every_n_steps is not None and due(step, self.invariance_every_n_steps):
            self._probe_point(step, sweep=False)
        last = self.max_steps - 1 if self.max_steps else None
        measures = due(step, self.every_n_steps, last) or self._after.wants_measurement
        if self.meter.off_reason or not measures:
            return False
        self._measuring = step
        self.meter.start()
        return True

    @guarded
    def stop(self) -> dict[str, float] | None:
        """Unhook, merge across processes and write the step's metrics (rank zero); returns
        them, or None when this step was not measured.  Every process must call it.  After
        the last step (``max_steps``) the run ends here (see :meth:`close`)."""
        step, self._measuring = self._measuring, None
        if self._started is not None:
            self._after.every_step(self._started, self._emit, self._stop_run, measured=step is not None)
            self._after.loss(self._started, self._emit, self._stop_run)
        metrics = None if step is None else self._finish(step)
        if self.max_steps and self._started == self.max_steps - 1:
            self._end(self._started)
        return metrics

    @guarded
    def add_loss(self, loss) -> None:
        """The training loss of a micro-batch of the step in progress (a 0-dim tensor or a
        number; not read until the step's end, and then without a host sync on a GPU), for the
        findings' loss rule (``loss_blowup``: the loss above 1.5x its running minimum, said with
        what the norms did).  Under several processes, call it on every process or on none."""
        self._after.add_loss(loss)

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
        """End a measured step without its numbers (the loop's step raised): no hook of the step
        is left (the every-step growth's stay until :meth:`close`)."""
        self._measuring = None
        self.meter.abort()

    @guarded
    def close(self) -> None:
        """End the run, after the last update (once; nothing more when the last step of
        ``max_steps`` ended it): the invariance point after that update with its scale sweep,
        the ladder over training (a picture) and the summary.  A step still open is dropped."""
        self.shut()
        if self._started is not None:
            self._end(self._started + 1)

    def _finish(self, step: int) -> dict[str, float] | None:
        last = self.max_steps is not None and step == self.max_steps - 1
        return self._after.measured(step, self._emit, self._stop_run, write_image=self._write_image,
                                    last=last)

    def _stop_run(self) -> None:
        """``on_finding`` asked to stop: the loop reads :attr:`should_stop`."""
        self.should_stop = True

    def _end(self, step: int) -> None:
        """The invariance point of ``step`` with its sweep, the heatmap and the summary (once)."""
        if self._ended:
            return
        self._ended = True
        self._probe_point(step, sweep=True)
        self._after.end(self._write_image, f"{model_class(self.meter.model)}, end of training")

    # -- writing -----------------------------------------------------------------------

    def _emit(self, step: int, metrics: dict[str, float], result=None) -> bool:
        """Keep and write ``metrics`` of ``step`` (rank zero; True on every rank: each has the
        step's merged numbers)."""
        if not _rank_zero():
            return True
        self._kept.add(step, metrics)
        if self._write is not None:
            try:
                self._write(metrics, step)
            except Exception as err:  # noqa: BLE001 - the user's writer must not stop training
                self._write = None
                self.voice.warn("writer", f"LoopMonitor: the writer failed ({err!r}); nothing more is "
                                          "written (training goes on)")
        return True

    # -- the invariance probe ----------------------------------------------------------

    def _start_probe(self, batch, loss_fn: Callable | None, size: int | None, final_norm: str | None) -> None:
        """The probe of the user's model (its own forward, on rank zero alone: no wrapper's
        collective), on the first ``size`` rows of ``batch`` moved to the model's device.  A
        sharded model (FSDP2, tensor parallelism) is probed by every rank on rank zero's rows
        (its forward is a collective)."""
        model = self.meter.model
        if batch is None:
            self.voice.say("LoopMonitor: no probe_batch=, so the final-norm invariance probe does not run; "
                           "pass held-out rows (probe_batch=(x, y), or a dict of the model's inputs) to "
                           "have it.")
            return
        if fsdp1(model):
            self._points.off(FSDP1_REFUSED)
            return
        rows = probe_batch(batch, size)
        self._every_rank = sharded(model) and dist.is_available() and dist.is_initialized()
        if self._every_rank:
            rows = _from_rank_zero(rows)
        device = next(model.parameters()).device
        self._points.begin(InvarianceProbe(model, loss_fn, final_norm=final_norm, meter=self.meter),
                           map_tensors(rows, lambda t: t.to(device)))

    def _probe_point(self, step: int, *, sweep: bool) -> None:
        """The invariance point of ``step`` (its sweep too with ``sweep``), on rank zero (every
        rank of a sharded model, which writes from rank zero)."""
        if not (self._every_rank or _rank_zero()):
            return
        taken = self._points.take(step, sweep=sweep)
        if taken is not None and _rank_zero():
            self._after.log(step, taken[0], self._emit)


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
