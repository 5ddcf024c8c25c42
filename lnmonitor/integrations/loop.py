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
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist
from torch import nn

from lnmonitor.core import arguments
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
    A writer that raises is said once and dropped; training goes on.
    """

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
        keep_history = arguments.optional_flag(keep_history, "keep_history")
        self._write: Callable | None = metric_writer(writer, LADDER_LAYOUT)
        self._keep = writer is None if keep_history is None else keep_history
        self.history: list[dict[str, float]] = []
        self.last_result: LadderResult | None = None
        self._warned: set[str] = set()
        self.meter = LadderMeter(
            model, include=arguments.patterns(include, "include"),
            exclude=arguments.patterns(exclude, "exclude"),
            final_norm=arguments.module_name(final_norm, "final_norm", "transformer.ln_f"),
            ladder=arguments.patterns(ladder, "ladder"), row_mask=arguments.row_mask(row_mask),
            owner="LoopMonitor", warn=self._warn,
        )
        self._measuring: int | None = None
        self._logged = False

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def start(self, step: int) -> bool:
        """Hook the norms if optimizer step ``step`` is due; True when it is measured."""
        last = self.max_steps - 1 if self.max_steps else None
        if self._measuring is not None or self.meter.off_reason or not due(step, self.every_n_steps, last):
            return False
        self._measuring = step
        self.meter.start()
        return True

    def stop(self) -> dict[str, float] | None:
        """Unhook, merge across processes and write the step's metrics (rank zero); returns
        them, or None when this step was not measured.  Every process must call it."""
        step, self._measuring = self._measuring, None
        if step is None:
            return None
        self.meter.stop()
        gather = dist if dist.is_available() and dist.is_initialized() else None
        result = self.meter.result(gather, label=f"step {step}")
        if result is None:
            return None
        self.last_result = result
        metrics = result.metrics(positions=not self._logged)
        self._logged = True
        if gather is not None and dist.get_rank() != 0:
            return metrics
        if self._keep:
            self.history.append({"step": step, **metrics})
        if self._write is not None:
            try:
                self._write(metrics, step)
            except Exception as err:  # noqa: BLE001 - the user's writer must not stop training
                self._write = None
                self._warn("writer", f"LoopMonitor: the writer failed ({err!r}); nothing more is written "
                                     "(training goes on)")
        return metrics

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Measure the forward and backward passes inside the block if ``step`` is due."""
        self.start(step)
        try:
            yield
        except BaseException:
            self._measuring = None
            self.meter.abort()
            raise
        self.stop()
