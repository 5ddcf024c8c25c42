"""The whole LayerNorm story of one tiny-GPT checkpoint, as one :class:`Analysis`.

:func:`analyze` runs the held-out measurement every experiment shares
(:func:`lnmonitor.experiments.measure.measure_held_out`: loss, shares, ladder, invariance) and the
structural probes of :mod:`lnmonitor.core.probes` at one position (each norm's Jacobian
against autograd, block versus branch rank).  :mod:`lnmonitor.experiments.analysis_report`
turns the result into tables, JSON and figures.

The probes are model-agnostic; two things here are specific to the tiny GPT and say
so: the loss (``module(x, y)`` returns ``(logits, loss)``) and the names of the
residual-stream points in the ladder (the input of ``blocks.0.ln1`` is the embedding,
of ``blocks.i.ln2`` the stream after block i's attention, of ``blocks.i+1.ln1`` /
``lnf`` the stream after block i's MLP).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from lnmonitor.core.heldout import LadderRow, ShareRow
from lnmonitor.core.invariance import InvarianceResult
from lnmonitor.core.probes import (
    BlockRankProbe,
    NormJacobianProbe,
    SequenceCapture,
    find_blocks,
    probe_block_rank,
    probe_norm_jacobian,
)
from lnmonitor.errors import UsageError
from lnmonitor.experiments.measure import measure_held_out
from lnmonitor.tiny.model import TinyGPT

__all__ = ["Analysis", "analyze", "stream_labels"]


@dataclass
class Analysis:
    """Everything :func:`analyze` measured.  ``share_values`` (per-row shares, for the
    figures) is not written to JSON."""

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
    shares: list[ShareRow]
    ladder: list[LadderRow]
    attenuation: float
    growth: float
    invariance: InvarianceResult | None
    seconds: float = 0.0
    share_values: dict[str, np.ndarray] = field(default_factory=dict, repr=False)


def stream_labels(module) -> dict[str, str]:
    """Names of the residual-stream points the tiny GPT's norms read (specific to TinyGPT:
    pre-norm blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, final ``lnf``)."""
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
    """Run every probe on ``module`` (a :class:`TinyGPTModule`) over the ``held_out`` batches
    ``(x, y)`` (:meth:`lnmonitor.tiny.data.CharDataModule.val_batches`).

    ``batches``: how many held-out batches to measure the shares and the ladder on (all
    when None).  ``position``: the sequence position of the Jacobian probes.  The loss
    covers every held-out window; the invariance cases and the scale sweep run on the
    probe rows (:data:`lnmonitor.experiments.measure.PROBE_WINDOWS`).
    """
    started = time.perf_counter()
    hp = module.hparams
    context = int(hp["context"])
    if isinstance(position, bool) or not isinstance(position, int) or not -context <= position < context:
        raise UsageError(
            f"position must be an integer in [-{context}, {context}) (the context), got {position}"
        )
    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 1):
        raise UsageError(f"batches must be a positive integer, got {batches!r}")
    m = measure_held_out(module.eval(), held_out, norm_batches=batches, invariance=invariance,
                labels=stream_labels(module))
    blocks = find_blocks(module, m.norms)
    with torch.no_grad(), SequenceCapture(blocks, m.norms) as cap:
        module(held_out[0][0][:1])
    block_probes = [
        probe_block_rank(block, cap.blocks[name], m.norms, position=position, name=name, rtol=rtol)
        for name, block in blocks
    ]
    norm_probes = [probe_norm_jacobian(info, cap.norms[info.name][position], rtol=rtol) for info in m.norms]
    return Analysis(
        checkpoint=str(checkpoint), step=step, config=dict(hp), data=data_name,
        batches=len(held_out) if batches is None else min(batches, len(held_out)),
        rows=m.windows["norms"] * context, val_loss=m.val_loss, position=position % context,
        norms=norm_probes, blocks=block_probes, shares=m.shares, ladder=m.ladder,
        attenuation=m.attenuation, growth=m.growth, invariance=m.invariance,
        seconds=time.perf_counter() - started, share_values={r.name: r.share for r in m.rows},
    )
