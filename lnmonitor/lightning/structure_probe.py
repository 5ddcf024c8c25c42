"""The Lightning callback measuring block versus branch rank and each norm's gain spread after validation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from typing_extensions import override

from lnmonitor.core.monitor import arguments
from lnmonitor.core.monitor.shared import guarded, off_message
from lnmonitor.core.norms.find import NormInfo, find_norms
from lnmonitor.core.output.metric_names import probe_metric
from lnmonitor.core.probes.blocks import SequenceCapture, find_blocks, resolve_branch
from lnmonitor.core.probes.structure import (
    BlockRankProbe,
    NormJacobianProbe,
    probe_block_rank,
    probe_norm_jacobian,
)
from lnmonitor.lightning.base import MonitorCallback, misconfiguration

__all__ = ["ProbeResult", "StructureProbe"]


@dataclass
class ProbeResult:
    """What one run of the probe measured (kept as :attr:`StructureProbe.last`)."""

    step: int
    position: int
    blocks: list[BlockRankProbe] = field(default_factory=list)
    norms: list[NormJacobianProbe] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        keys = ("block_rank", "block_sv_min", "block_sv_max", "branch_rank", "branch_sv_min", "branch_sv_max")
        out = {probe_metric(key, b.name): float(getattr(b, key)) for b in self.blocks for key in keys}
        out.update({probe_metric("gain_spread", n.name): n.gain_spread for n in self.norms})
        return out


class StructureProbe(MonitorCallback):
    r"""Measure block versus branch rank and each norm's gain spread at the end of validation.

    On the first validation batch temporary forward hooks keep one sequence of each residual block's input
    and each norm's input row at ``position``; at the end of validation it differentiates float64 CPU copies
    of the blocks (:func:`~lnmonitor.core.probes.structure.probe_block_rank`) and the norms
    (:func:`~lnmonitor.core.probes.structure.probe_norm_jacobian`).  The model is not modified and no hook
    outlives that batch.  For the tiny GPT (width 128, 4 blocks) a run costs well under a second on a CPU;
    for bigger models raise ``every_n_validations``.  Sanity-check validation is skipped; only global rank
    zero measures and logs (no collectives).  An error while probing turns the probe off with one warning;
    training goes on.

    Args:
        every_n_validations: probe on every n-th validation run (1: every one).
        position: the sequence position probed (negative counts from the end; default the last, where
            causal attention sees the whole context).
        blocks: qualified name of the ``ModuleList`` of residual blocks in the LightningModule (e.g.
            ``"model.blocks"``); ``None`` finds the ModuleList of repeated modules that contain a norm.
        branch: the branch through each block's first norm: child names applied in order (e.g.
            ``("ln1", "attn")``), a callable ``(block, h) -> output``, or ``None`` for the first norm child
            and the child registered after it.
        rtol: rank tolerance relative to the largest singular value; ``None`` uses numpy's ``matrix_rank``
            rule ``s_max * d * eps_float64``.
        norm_jacobians: ``False`` to skip the per-norm Jacobian probe (the gain spread).

    Logged metrics (through every logger in ``trainer.loggers``, at ``trainer.global_step``; ``<block>`` and
    ``<norm>`` are qualified names in the LightningModule):

    - ``lnmonitor/probe/block_rank/<block>``: numerical rank of ``d block(h)[p] / d h[p]`` (the width when the
      residual keeps the block invertible);
    - ``lnmonitor/probe/block_sv_min/<block>``, ``lnmonitor/probe/block_sv_max/<block>``: its smallest and
      largest singular values;
    - ``lnmonitor/probe/branch_rank/<block>``, ``lnmonitor/probe/branch_sv_min/<block>``,
      ``lnmonitor/probe/branch_sv_max/<block>``: the same for the branch through the first norm
      (``attn(ln1(.))``), below the width because the norm deletes directions;
    - ``lnmonitor/probe/gain_spread/<norm>``: max/min nonzero singular value of ``diag(g) (1/sigma) P`` at the
      probed row (1 for a gain of ones).

    The latest results are kept in :attr:`last` (a :class:`ProbeResult`).

    Raises:
        MisconfigurationException: for invalid arguments (in ``__init__``) or, at ``setup``, when the model
            has no norm, no residual blocks or no branch to probe.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lnmonitor import StructureProbe
        >>> probe = StructureProbe(every_n_validations=2)
        >>> trainer = Trainer(callbacks=[probe])
    """

    def __init__(self, every_n_validations: int = 1, position: int = -1, blocks: str | None = None,
                 branch: Sequence[str] | Callable[[nn.Module, Tensor], Tensor] | None = None,
                 rtol: float | None = None, norm_jacobians: bool = True) -> None:
        with misconfiguration():
            self.every_n_validations = arguments.positive_int(every_n_validations, "every_n_validations",
                                                              allow_none=False, unit="validation runs")
            self.position = arguments.position(position, "position", "-1 for the last")
            self.blocks = arguments.module_name(blocks, "blocks", "model.blocks")
            self.branch = arguments.child_path(branch, "branch")
            self.rtol = arguments.fraction(rtol, "rtol", "None is numpy's rank rule")
            self.norm_jacobians = arguments.flag(norm_jacobians, "norm_jacobians")
        super().__init__(keep_history=None)
        self.last: ProbeResult | None = None
        self._validations = 0
        self._block_list: list[tuple[str, nn.Module]] = []
        self._found: list[NormInfo] = []
        self._norm_list: list[NormInfo] = []
        self._measuring = False
        self._capture: SequenceCapture | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_validations=self.every_n_validations, position=self.position,
                                        blocks=self.blocks)

    @override
    @guarded(starts_run=True)
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()
        self.last, self._validations, self._measuring = None, 0, False
        self._loggers.setup(trainer)
        self._found = found = find_norms(pl_module)
        try:
            self._block_list = find_blocks(pl_module, found, self.blocks)
            for _, block in self._block_list:
                resolve_branch(block, found, self.branch)
        except ValueError as err:
            raise MisconfigurationException(f"StructureProbe: {err}") from None
        self._norm_list = found if self.norm_jacobians else []
        if self.norm_jacobians and not found:
            raise MisconfigurationException("StructureProbe found no normalisation layer in the model: "
                                            "register yours with lnmonitor.register_norm, or pass "
                                            "norm_jacobians=False")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"validations": self._validations}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validations = int(state_dict.get("validations", 0))

    @override
    @guarded
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measuring = False
        if trainer.sanity_checking:
            return
        self._validations += 1
        due = (self._validations - 1) % self.every_n_validations == 0
        self._measuring = due and trainer.is_global_zero and bool(self._block_list)
        self._release()

    @override
    @guarded
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._measuring and self._capture is None:
            self._capture = SequenceCapture(self._block_list, self._norm_list)
            self._capture.attach()

    @override
    @guarded
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._capture is not None:
            self._capture.detach()

    def detach(self) -> None:
        self._release()

    def _release(self) -> SequenceCapture | None:
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.detach()
        return capture

    @override
    @guarded
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        capture = self._release()
        measuring, self._measuring = self._measuring, False
        if not measuring or capture is None:
            return
        if not capture.blocks:
            self._loggers.warn_once("no-block", "StructureProbe: no residual block ran on a (..., time, "
                                    "width) input during validation; nothing was probed")
            return
        try:
            result = self._probe(trainer.global_step, capture)
        except Exception as err:  # noqa: BLE001 - a probe must never stop the user's training
            self._block_list = []
            self._loggers.warn_once("off", off_message("StructureProbe", f"{type(err).__name__}: {err}"))
            return
        self.last = result
        self._loggers.log(trainer, trainer.global_step, result.metrics())

    def _probe(self, step: int, capture: SequenceCapture) -> ProbeResult:
        result = ProbeResult(step=step, position=self.position)
        for name, block in self._block_list:
            h = capture.blocks.get(name)
            if h is None or not -h.shape[0] <= self.position < h.shape[0]:
                continue
            probe = probe_block_rank(block, h, self._found, position=self.position, name=name,
                                     branch=self.branch, rtol=self.rtol)
            result.blocks.append(probe)
            result.position = probe.position
        for info in self._norm_list:
            seq = capture.norms.get(info.name)
            if seq is not None and -seq.shape[0] <= self.position < seq.shape[0]:
                result.norms.append(probe_norm_jacobian(info, seq[self.position], rtol=self.rtol))
        return result

    @override
    @guarded
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()
        self._measuring = False

    @override
    @guarded
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validations == 0 and self._block_list and trainer.is_global_zero:
            self._loggers.warn_once("never-ran", "StructureProbe never ran in this fit: it probes at the end "
                                    "of validation and no validation ran. Add validation data, or run "
                                    "`lnmonitor analyze` on the checkpoint.")

    @override
    @guarded
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()
        self._measuring = False
