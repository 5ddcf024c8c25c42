"""The whole LayerNorm story of one tiny-GPT checkpoint as one :class:`Analysis` (:func:`analyze`): the
held-out measurement every experiment shares and the structural probes (each norm's Jacobian against
autograd, block versus branch rank) at one position.  Specific to the tiny GPT: the loss (``module(x, y)``
returns ``(logits, loss)``) and the names of the residual-stream points (:func:`stream_labels`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lnmonitor.core.hooks import Hooks, eval_mode
from lnmonitor.core.invariance.results import InvarianceResult
from lnmonitor.core.meter.meter import LadderResult, NormFigures
from lnmonitor.core.meter.row_stats import RowStats
from lnmonitor.core.probes.blocks import SequenceCapture, find_blocks
from lnmonitor.core.probes.structure import (
    BlockRankProbe,
    NormJacobianProbe,
    probe_block_rank,
    probe_norm_jacobian,
)
from lnmonitor.errors import UsageError
from lnmonitor.experiments.measure import held_out_measurement
from lnmonitor.tiny.model import TinyGPT
from lnmonitor.views.names import short_name

__all__ = [
    "REFERENCE", "STUDY_NOTE", "STUDY_SEQUENCES", "Analysis", "StudyRung", "analyze", "stream_labels",
    "study_ladder",
]

STUDY_SEQUENCES = 8  # the study's ladder used one batch of 8 sequences (docs/design.md)

# the study this project grew out of (docs/design.md): 4 x 128 LayerNorm GPT, eps 1e-5, 3,000 steps
REFERENCE = {
    "val_loss": "1.573 (65 symbols)", "share_median": "0.087 .. 0.144", "share_max_above": "9 of 9",
    "final_share_max": "0.83", "block_rank": "128/128", "block_sv": "0.36 .. 2.50", "branch_rank": "123",
    "rms": "0.90 -> 3.90 (4.3x)", "inv_sigma": "1.112 -> 0.323 (3.4x)", "shift_scale": "0 / 0 (identical)",
    "slope": "0.97 / 0.049", "gain_spread": "< 2x", "jacobian_error": "-",
}

# what the rows marked "study's" compute, and what is not known of the study (docs/design.md)
STUDY_NOTE = (
    "The study's statistics: its ladder rms is the global rms over all rows and features of one batch of "
    "8 sequences, its sigma the median over rows of the per-row unbiased std (h.std(-1).median(), no eps); "
    "ours are the median row's rms and sqrt(v + eps) over every measured row. Its block singular values "
    "are those of one block. Its rank tolerance is not on record: d x 2^-23 of the largest singular value "
    "is torch.linalg.matrix_rank's default on a float32 matrix."
)


@dataclass(frozen=True)
class StudyRung:
    """One rung of the ladder as the study computed it on the first :data:`STUDY_SEQUENCES` held-out
    sequences: ``rms`` the global rms over all their rows and features, ``std`` the median over rows of the
    per-row unbiased std (no eps).  Shown beside the meter's statistics, never under a monitor's name."""

    name: str
    rms: float
    std: float


def study_ladder(module, x: torch.Tensor, norms) -> list[StudyRung]:
    """The study's rms and std of the input of each of ``norms`` over the first :data:`STUDY_SEQUENCES`
    sequences of the token batch ``x``."""
    inputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(mod, args):
            if name not in inputs and args and isinstance(args[0], torch.Tensor):
                inputs[name] = args[0].detach().to(torch.float64)

        return hook

    with torch.no_grad(), Hooks() as hooks:
        for info in norms:
            hooks.forward_pre(info.module, keep(info.name))
        module(x[:STUDY_SEQUENCES])
    return [StudyRung(info.name, rms=float(inputs[info.name].pow(2).mean().sqrt()),
                      std=float(inputs[info.name].std(-1).median()))
            for info in norms if info.name in inputs]


@dataclass
class Analysis:
    """Everything :func:`analyze` measured.  ``result`` is the meter's (with its histograms): the norms with
    their roles, figures, ladder and baselines exactly as a monitor logs them; ``labels`` name the
    residual-stream point each rung reads."""

    checkpoint: str
    step: int | None
    config: dict
    data: str
    batches: int
    rows: int
    val_loss: float
    position: int
    norms: list[NormJacobianProbe]
    blocks: list[BlockRankProbe]
    result: LadderResult
    invariance: InvarianceResult | None
    labels: dict[str, str] = field(default_factory=dict)
    study: list[StudyRung] = field(default_factory=list)
    study_sequences: int = 0
    seconds: float = 0.0

    @property
    def rungs(self) -> list[NormFigures]:
        """The ladder's rungs' figures, in forward order (the final norm last)."""
        by_name = self.result.figures.by_name()
        return [by_name[name] for name in self.result.figures.rungs]

    def short(self, name: str) -> str:
        """``name`` as this analysis's tables and figures show it, beside the other measured norms."""
        return short_name(name, [info.name for info in self.result.norms])

    def per_norm(self) -> list[tuple[NormFigures, RowStats]]:
        """Every measured norm's figures and row statistics (with its histograms), in the meter's order."""
        return list(zip(self.result.figures.norms, self.result.row_stats, strict=True))


def stream_labels(module) -> dict[str, str]:
    """Names of the residual-stream points a TinyGPT's norms read (pre-norm blocks, final ``lnf``); {} for
    another model."""
    model = getattr(module, "model", module)
    if not isinstance(model, TinyGPT):
        return {}
    prefix = "model." if model is not module else ""
    depth = len(model.blocks)
    labels = {f"{prefix}blocks.0.ln1": "embedding", f"{prefix}lnf": f"after block {depth - 1} MLP"}
    for i in range(depth):
        labels[f"{prefix}blocks.{i}.ln2"] = f"after block {i} attention"
        if i + 1 < depth:
            labels[f"{prefix}blocks.{i + 1}.ln1"] = f"after block {i} MLP"
    return labels


def analyze(
    module, held_out: list, *, data_name: str = "", batches: int | None = None, position: int = -1,
    rtol: float | None = None, checkpoint: str = "", step: int | None = None,
    invariance: bool = True,
) -> Analysis:
    """Run every probe on ``module`` (a :class:`TinyGPTModule`) over the ``held_out`` batches ``(x, y)``.

    ``batches``: how many held-out batches the shares and the ladder use (all when None); ``position``: the
    sequence position of the Jacobian probes.  The loss covers every window, the invariance the probe rows.
    """
    started = time.perf_counter()
    hp = module.hparams
    context = int(hp["context"])
    if isinstance(position, bool) or not isinstance(position, int) or not -context <= position < context:
        raise UsageError(f"position must be an integer in [-{context}, {context}) (the context), "
                         f"got {position}")
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
        raise UsageError(f"batches must be a positive integer, got {batches!r}")
    m = held_out_measurement(module, held_out, norm_batches=batches, invariance=invariance, counts=True)
    blocks = find_blocks(module, m.norms)
    with eval_mode(module):
        with torch.no_grad(), SequenceCapture(blocks, m.norms) as cap:
            module(held_out[0][0][:1])
        block_probes = [probe_block_rank(block, cap.blocks[name], m.norms, position=position, name=name,
                                         rtol=rtol) for name, block in blocks]
        norm_probes = [probe_norm_jacobian(info, cap.norms[info.name][position], rtol=rtol)
                       for info in m.norms]
        by_name = {info.name: info for info in m.norms}
        study = study_ladder(module, held_out[0][0], [by_name[name] for name in m.result.figures.rungs])
    return Analysis(
        checkpoint=str(checkpoint), step=step, config=dict(hp), data=data_name,
        batches=len(held_out) if batches is None else min(batches, len(held_out)),
        rows=m.windows["norms"] * context, val_loss=m.val_loss, position=position % context,
        norms=norm_probes, blocks=block_probes, result=m.result, invariance=m.invariance,
        labels=stream_labels(module), study=study,
        study_sequences=min(STUDY_SEQUENCES, int(held_out[0][0].shape[0])),
        seconds=time.perf_counter() - started,
    )
