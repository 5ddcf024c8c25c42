"""The plain-PyTorch door: the meter in a training loop of your own (nanoGPT's ``train.py``,
torchtitan, a notebook), in three added lines.

:class:`LoopMonitor` decides which steps :class:`~lnmonitor.core.meter.LadderMeter` measures
(every ``every_n_steps``-th and the last), merges them across ``torch.distributed``
processes when a process group is up, and writes the numbers from rank zero to a
TensorBoard ``SummaryWriter`` or a function of your own -- the metric names the Lightning
callback logs.  No Lightning is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist
from torch import nn

from lnmonitor.core import arguments
from lnmonitor.core.discovery import NormSelectionError
from lnmonitor.core.door import History, Voice, guarded
from lnmonitor.core.meter import LadderMeter, LadderResult, due
from lnmonitor.core.metric_names import LADDER_LAYOUT
from lnmonitor.core.writers import metric_writer

__all__ = ["LoopMonitor"]


class LoopMonitor:
    r"""Measure a model's norms on every ``every_n_steps``-th optimizer step of a plain loop.

    Wrap the forward and backward passes of a step (all its micro-batches) in
    :meth:`step`, or call :meth:`start` before and :meth:`stop` after them; the hooks
    exist only inside a measured step, and the step's numbers are written when it ends.

    Args:
        model: the module whose norms are measured (the one you call, or the module
            inside a ``DistributedDataParallel``); names are qualified from it.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (the metrics as one event per
            step and the custom-scalars layout), a function ``write(metrics, step)``, or
            None (keep them in :attr:`history` only).
        every_n_steps: measure the steps whose index is a multiple of this (default 50).
        max_steps: the number of optimizer steps, when known: the last is measured too.
        include, exclude, final_norm, ladder: as for
            :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor`.
        row_mask: which rows (tokens) to measure: None (default) leaves out the padding that
            the model's keyword inputs mark (``model(**batch)`` with an
            ``attention_mask``); ``False`` measures every row; a callable ``row_mask(inputs)``
            of the model's keyword inputs returns a bool tensor of the rows to measure.
        keep_history: keep every written dict in :attr:`history`; None keeps them only
            when there is no ``writer``.

    Raises:
        lnmonitor.core.arguments.ArgumentError: an argument of the wrong type or range.
        lnmonitor.core.discovery.NormSelectionError: the model has no norm it can measure as asked.
        TypeError: ``writer`` is neither a SummaryWriter nor a function.

    Example::

        >>> import torch
        >>> from lnmonitor.integrations.loop import LoopMonitor
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> monitor = LoopMonitor(model, every_n_steps=1)
        >>> with monitor.step(0):
        ...     model(torch.randn(4, 8)).pow(2).sum().backward()
        >>> monitor.history[0]["step"], "lnmonitor/sigma/1" in monitor.history[0]
        (0, True)

    It writes the metrics of
    :class:`~lnmonitor.lightning.layernorm_monitor.LayerNormMonitor` (``lnmonitor/sigma/<norm>``,
    ``lnmonitor/ladder/attenuation``, ...), each at the step index given to :meth:`start`.
    A writer that raises is said once and dropped; training goes on.  :meth:`start` and
    :meth:`stop` run inside :func:`~lnmonitor.core.door.guarded`: an exception there turns the
    monitor off with one warning naming the cause (:attr:`off_reason`), and the loop goes on.
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
        keep_history: bool | None = None,
    ) -> None:
        self.every_n_steps = arguments.positive_int(every_n_steps, "every_n_steps", allow_none=False)
        self.max_steps = arguments.positive_int(max_steps, "max_steps")
        self.owner = "LoopMonitor"
        self.voice = Voice()
        self.off_reason: str | None = None
        self._kept = History(arguments.optional_flag(keep_history, "keep_history"))
        self._kept.reset(receivers=writer is not None)
        self._write: Callable | None = metric_writer(writer, LADDER_LAYOUT)
        self.last_result: LadderResult | None = None
        self.meter = LadderMeter(
            model, include=arguments.patterns(include, "include"),
            exclude=arguments.patterns(exclude, "exclude"),
            final_norm=arguments.module_name(final_norm, "final_norm", "transformer.ln_f"),
            ladder=arguments.patterns(ladder, "ladder"), row_mask=arguments.row_mask(row_mask),
            owner=self.owner, say=self.voice.say, warn=self.voice.warn,
        )
        self._measuring: int | None = None
        self._logged = False

    @property
    def history(self) -> list[dict[str, float]]:
        """Every dict written, with its ``step`` (see ``keep_history``)."""
        return self._kept.rows

    def shut(self) -> None:
        """Remove the hooks and forget the step in progress (the guard tripped)."""
        self._measuring = None
        self.meter.abort()

    @guarded
    def start(self, step: int) -> bool:
        """Hook the norms if optimizer step ``step`` is due; True when it is measured."""
        last = self.max_steps - 1 if self.max_steps else None
        if self._measuring is not None or self.meter.off_reason or not due(step, self.every_n_steps, last):
            return False
        self._measuring = step
        self.meter.start()
        return True

    @guarded
    def stop(self) -> dict[str, float] | None:
        """Unhook, merge across processes and write the step's metrics (rank zero); returns
        them, or None when this step was not measured.  Every process must call it."""
        step, self._measuring = self._measuring, None
        if step is None:
            return None
        self.meter.stop()
        result = self.meter.result(dist, label=f"step {step}")
        if result is None:
            return None
        self.last_result = result
        metrics = result.metrics(positions=not self._logged)
        self._logged = True
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return metrics
        self._kept.add(step, metrics)
        if self._write is not None:
            try:
                self._write(metrics, step)
            except Exception as err:  # noqa: BLE001 - the user's writer must not stop training
                self._write = None
                self.voice.warn("writer", f"LoopMonitor: the writer failed ({err!r}); nothing more is "
                                          "written (training goes on)")
        return metrics

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
        """End a measured step without its numbers (the loop's step raised): no hook is left."""
        self.shut()
