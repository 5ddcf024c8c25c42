"""``StructureProbe``: the block/branch rank and gain-spread probes as a Lightning callback."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lnmonitor.probes import (
    BlockRankProbe,
    NormJacobianProbe,
    SequenceCapture,
    find_blocks,
    probe_block_rank,
    probe_norm_jacobian,
    resolve_branch,
)
from lnmonitor.taps import find_norms

__all__ = ["ProbeResult", "StructureProbe"]

PREFIX = "lnmonitor/probe"


def _integer(value) -> int | None:
    """``value`` as an int when it is an integer (int, numpy integers), not a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return int(operator.index(value))
    except TypeError:
        return None


@dataclass
class ProbeResult:
    """What one run of the probe measured (kept as :attr:`StructureProbe.last`)."""

    step: int
    position: int
    blocks: list[BlockRankProbe] = field(default_factory=list)
    norms: list[NormJacobianProbe] = field(default_factory=list)

    def metrics(self, prefix: str = PREFIX) -> dict[str, float]:
        out: dict[str, float] = {}
        for b in self.blocks:
            out[f"{prefix}/block_rank/{b.name}"] = float(b.block_rank)
            out[f"{prefix}/block_sv_min/{b.name}"] = b.block_sv_min
            out[f"{prefix}/block_sv_max/{b.name}"] = b.block_sv_max
            out[f"{prefix}/branch_rank/{b.name}"] = float(b.branch_rank)
            out[f"{prefix}/branch_sv_min/{b.name}"] = b.branch_sv_min
            out[f"{prefix}/branch_sv_max/{b.name}"] = b.branch_sv_max
        for n in self.norms:
            out[f"{prefix}/gain_spread/{n.name}"] = n.gain_spread
        return out


class StructureProbe(Callback):
    r"""Measure block versus branch rank and each norm's gain spread at the end of validation.

    On the first validation batch the callback keeps, through temporary forward hooks,
    one sequence of each residual block's input and each norm's input row at
    ``position``; at the end of validation it differentiates float64 CPU copies of the
    blocks (:func:`lnmonitor.probes.probe_block_rank`) and of the norms
    (:func:`lnmonitor.probes.probe_norm_jacobian`).  The model itself is not modified and
    no hook stays registered outside that batch.  For the tiny GPT (width 128, 4 blocks)
    a run costs well under a second on a CPU; for bigger models raise
    ``every_n_validations``.  Sanity-check validation is skipped; only global rank zero
    measures and logs (no collectives).

    Args:
        every_n_validations: probe on every n-th validation run (1: every one).
        position: the sequence position probed (negative counts from the end; default
            the last, where causal attention sees the whole context).
        blocks: qualified name of the ``ModuleList`` of residual blocks in the
            LightningModule (e.g. ``"model.blocks"``); ``None`` finds the ModuleList of
            repeated modules that contain a norm.
        branch: the branch through each block's first norm: child names applied in order
            (e.g. ``("ln1", "attn")``), a callable ``(block, h) -> output``, or ``None`` for
            the first norm child and the child registered after it.
        rtol: rank tolerance relative to the largest singular value; ``None`` uses numpy's
            ``matrix_rank`` rule ``s_max * d * eps_float64``.
        norms: ``False`` to skip the per-norm gain spread.

    Logged metrics (through every logger in ``trainer.loggers``, at ``trainer.global_step``):
        - ``lnmonitor/probe/block_rank/<block>``: numerical rank of ``d block(h)[p] / d h[p]``
          (the width when the residual keeps the block invertible);
        - ``lnmonitor/probe/block_sv_min/<block>``, ``lnmonitor/probe/block_sv_max/<block>``:
          its smallest and largest singular values;
        - ``lnmonitor/probe/branch_rank/<block>``, ``lnmonitor/probe/branch_sv_min/<block>``,
          ``lnmonitor/probe/branch_sv_max/<block>``: the same for the branch through the
          first norm (``attn(ln1(.))``), below the width because the norm deletes directions;
        - ``lnmonitor/probe/gain_spread/<norm>``: max/min nonzero singular value of
          ``diag(g) (1/sigma) P`` at the probed row (1 for a gain of ones).

        ``<block>`` and ``<norm>`` are qualified names in the LightningModule.  The latest
        results are also kept in :attr:`last` (a :class:`ProbeResult`).

    Raises:
        MisconfigurationException: for invalid arguments (in ``__init__``) or, at
            ``setup``, when the model has no norm, no residual blocks or no branch to probe.
    """

    def __init__(
        self,
        every_n_validations: int = 1,
        position: int = -1,
        blocks: str | None = None,
        branch: Sequence[str] | Callable[[nn.Module, Tensor], Tensor] | None = None,
        rtol: float | None = None,
        norms: bool = True,
    ) -> None:
        every = _integer(every_n_validations)
        if every is None or every < 1:
            raise MisconfigurationException(
                f"StructureProbe(every_n_validations={every_n_validations!r}): pass a positive integer "
                "(1 probes at every validation run)"
            )
        pos = _integer(position)
        if pos is None:
            raise MisconfigurationException(
                f"StructureProbe(position={position!r}): pass an integer sequence position "
                "(-1 for the last)"
            )
        if blocks is not None and not (isinstance(blocks, str) and blocks):
            raise MisconfigurationException(
                f"StructureProbe(blocks={blocks!r}): pass the qualified name of the blocks' ModuleList, "
                "e.g. 'model.blocks', or None to find it"
            )
        if branch is not None and not callable(branch):
            names: tuple | None = None
            if isinstance(branch, Iterable) and not isinstance(branch, (str, bytes, Mapping)):
                names = tuple(branch)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise MisconfigurationException(
                    f"StructureProbe(branch={branch!r}): pass a sequence of child names such as "
                    "('ln1', 'attn'), a callable (block, h) -> output, or None"
                )
            branch = names
        if rtol is not None and (
            isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or not 0.0 < rtol < 1.0
        ):
            raise MisconfigurationException(
                f"StructureProbe(rtol={rtol!r}): pass a float in (0, 1), or None for numpy's rank rule"
            )
        if not isinstance(norms, bool):
            raise MisconfigurationException(f"StructureProbe(norms={norms!r}): pass True or False")
        self.every_n_validations = every
        self.position = pos
        self.blocks = blocks
        self.branch = tuple(branch) if branch is not None and not callable(branch) else branch
        self.rtol = None if rtol is None else float(rtol)
        self.norms = norms
        self.last: ProbeResult | None = None
        self._validations = 0
        self._block_list: list[tuple[str, nn.Module]] = []
        self._norm_list: list = []
        self._measuring = False
        self._capture: SequenceCapture | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_validations=self.every_n_validations, position=self.position, blocks=self.blocks
        )

    # -- setup ---------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._block_list = find_blocks(pl_module, self.blocks)
            for _, block in self._block_list:
                resolve_branch(block, self.branch)
        except ValueError as err:
            raise MisconfigurationException(f"StructureProbe: {err}") from None
        self._norm_list = find_norms(pl_module) if self.norms else []
        if self.norms and not self._norm_list:
            raise MisconfigurationException(
                "StructureProbe found no normalisation layer in the model: register yours with "
                "lnmonitor.taps.register_norm, or pass norms=False"
            )

    # -- cadence -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self._validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validations = int(state_dict.get("validations", 0))

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measuring = False
        if trainer.sanity_checking:
            return
        self._validations += 1
        due = (self._validations - 1) % self.every_n_validations == 0
        self._measuring = due and trainer.is_global_zero and bool(self._block_list)
        self._release()

    # -- capture -------------------------------------------------------------------------

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._measuring and self._capture is None:
            self._capture = SequenceCapture(self._block_list, self._norm_list)
            self._capture.attach()

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:
        if self._capture is not None:
            self._capture.detach()

    def _release(self) -> SequenceCapture | None:
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.detach()
        return capture

    # -- measure and log -----------------------------------------------------------------

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        capture = self._release()
        measuring, self._measuring = self._measuring, False
        if not measuring or capture is None:
            return
        if not capture.blocks:
            rank_zero_warn(
                "StructureProbe: no residual block ran on a (..., time, width) input during "
                "validation; nothing was probed"
            )
            return
        result = ProbeResult(step=trainer.global_step, position=self.position)
        for name, block in self._block_list:
            h = capture.blocks.get(name)
            if h is None or not -h.shape[0] <= self.position < h.shape[0]:
                continue
            probe = probe_block_rank(
                block, h, position=self.position, name=name, branch=self.branch, rtol=self.rtol
            )
            result.blocks.append(probe)
            result.position = probe.position
        for info in self._norm_list:
            seq = capture.norms.get(info.name)
            if seq is not None and -seq.shape[0] <= self.position < seq.shape[0]:
                result.norms.append(probe_norm_jacobian(info, seq[self.position], rtol=self.rtol))
        self.last = result
        metrics = result.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()
        self._measuring = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validations == 0 and self._block_list and trainer.is_global_zero:
            rank_zero_warn(
                "StructureProbe never ran in this fit: it probes at the end of validation and no "
                "validation ran. Add validation data, or run `lnmonitor analyze` on the checkpoint."
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()
        self._measuring = False
