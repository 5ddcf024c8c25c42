"""LayerNormMonitor (and its siblings) under what real training throws at them: mixed precision,
gradient accumulation, torch.compile, activation checkpointing, resume, other norms, faults, ragged
batches, no validation, a norm never called, uneven DDP batches.  Each test would fail if the
behaviour regressed; the torch.compile and DDP tests are marked slow."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CONTEXT,
    NORMS,
    VOCAB,
    WIDTH,
    assert_close_history,
    check_against_reference,
    corpus,
    fit,
    float64_reference,
    free_port,
    gpt,
    loader,
    monitor,
    windows,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor, StructureProbe
from lnmonitor.core.maths import random_baseline
from lnmonitor.core.norms.find import describe_norm, find_norms
from lnmonitor.core.norms.registry import register_norm, unregister_norm
from lnmonitor.tiny import CharDataModule, TinyGPTModule

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*no logger.*:UserWarning",
    "ignore:.*validation_step.*val_dataloader.*",
    "ignore:Mismatch dtype between input and weight.*",
)


def test_fp16_mixed_trainer_with_grad_scaler():
    """Lightning refuses precision='16-mixed' on CPU (it switches to bf16), but its
    MixedPrecision plugin with a GradScaler runs real fp16 autocast on CPU: the logged
    values do not depend on the loss scale, and a scale that overflows every gradient
    gives steps whose rows are all skipped and counted while training goes on."""
    def run(init_scale, steps=2):
        module = gpt(steps, depth=1)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10_000)
        mon = monitor()
        trainer, _ = fit(module, loader(8, 4), [mon], steps,
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        assert trainer.global_step == steps
        return mon, scaler

    big, _ = run(2.0**16)
    small, _ = run(2.0**8)
    # same forward, gradients 256 times smaller: equal within the histograms' resolution
    # (not bit for bit: at the smaller scale some fp16 gradients are subnormal)
    assert_close_history(big.history[:1], small.history[:1])
    assert all(big.history[0][f"lnmonitor/skipped_rows/{n}"] == 0 for n in
               ("model.blocks.0.ln1", "model.lnf"))
    over, scaler = run(2.0**40)
    assert scaler.get_scale() < 2.0**40  # the scaler saw the overflow and backed off
    rows = 4 * CONTEXT
    for h in over.history:
        for n in ("model.blocks.0.ln1", "model.blocks.0.ln2", "model.lnf"):
            assert h[f"lnmonitor/skipped_rows/{n}"] == rows
            assert f"lnmonitor/share_median/{n}" not in h  # no share, not a false one
            assert math.isfinite(h[f"lnmonitor/sigma/{n}"])  # the forward was fine
    assert [h["step"] for h in over.history] == [0, 1]


def test_accumulated_step_measures_all_its_micro_batches():
    """Two micro-batches of 4 accumulated into one optimizer step give the statistics of
    one batch of 8: same rows, same values (per-row gradients are the same numbers)."""
    one = monitor()
    fit(gpt(4), loader(16, 8), [one], 2)
    acc = monitor()
    fit(gpt(4), loader(16, 4), [acc], 2, accumulate_grad_batches=2)
    assert [h["step"] for h in acc.history] == [0, 1]
    assert [s.rows for s in acc.last_row_stats] == [8 * CONTEXT] * 5
    assert_close_history(acc.history, one.history)
    # the largest share is an exact order statistic: it must come from the same row
    for n in NORMS:
        assert acc.history[0][f"lnmonitor/share_max/{n}"] == pytest.approx(
            one.history[0][f"lnmonitor/share_max/{n}"], rel=1e-5)


@pytest.mark.slow
def test_torch_compile_is_measured_eagerly_and_never_silently_empty(caplog, monkeypatch):
    """A compiled model (compiled and run before the fit, so hooks registered later are
    invisible to its code): the measured steps run eagerly and match an uncompiled copy;
    the unmeasured steps run the compiled graph, which our hooks neither break nor
    recompile.  Without set_stance (older torch) the monitor cannot see the norms and
    says so instead of logging nothing."""
    import torch._dynamo

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    steps = 3
    module = gpt(steps, depth=1)
    module.model = torch.compile(module.model)
    x, y = windows(4)
    module(x, y)[1].backward()  # compiled now, without hooks
    module.zero_grad()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1

    # 1. as on a torch without torch.compiler.set_stance: the hooks never fire
    with monkeypatch.context() as patch:
        patch.setattr("lnmonitor.core.meter.meter.eager", contextlib.nullcontext)
        blind = monitor(every_n_steps=2)
        _, caught = fit(module, loader(12, 4), [blind], 2)
    assert sum("none of the 3 selected norms ran with gradient" in w for w in caught) == 1
    assert blind.history == []  # a step with nothing measured logs nothing (and is said, above)

    # 2. the monitor as shipped, against an uncompiled copy with the same weights
    uncompiled = gpt(steps, depth=1)
    uncompiled.model.load_state_dict(module.model._orig_mod.state_dict())
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=2, on_validation=False, keep_history=True,
                                     probe_batch=windows(2, seed=1), scales=())
    mon = monitor(every_n_steps=2)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _, caught = fit(module, loader(12, 4), [mon, inv], steps)
    said = [r for r in caplog.records if "the model is compiled" in r.getMessage()]
    assert len(said) == 1
    assert not any("selected norms" in w for w in caught)
    assert [h["step"] for h in mon.history] == [0, 2]
    assert [s.rows for s in mon.last_row_stats] == [4 * CONTEXT] * 3
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for the hooks
    assert not any("lnmonitor" in str(k) for k in counters["graph_break"])
    # the invariance hook fired on the compiled model: the control moves, shifts do not
    assert [h["step"] for h in inv.history] == [0, 2, 3]  # 3: the end-of-fit probe
    for h in inv.history:
        assert h["lnmonitor/invariance/shift_5/dloss"] == 0.0
        assert abs(h["lnmonitor/invariance/axis_5/dloss"]) > 0

    same = monitor(every_n_steps=2)
    fit(uncompiled, loader(12, 4), [same], 1)
    rename = {k.replace("model._orig_mod.", "model."): v for k, v in mon.history[0].items()}
    assert_close_history([rename], same.history[:1])


class CheckpointedGPT(TinyGPTModule):
    """TinyGPT whose blocks run under torch.utils.checkpoint (``reentrant`` True/False),
    or plainly (``None``); counts the forward calls of each block."""

    def __init__(self, *args, reentrant: bool | None = None, **kw):
        super().__init__(*args, **kw)
        self.reentrant = reentrant
        self.block_calls = 0

        def count(m, a):
            self.block_calls += 1

        for block in self.model.blocks:
            block.register_forward_pre_hook(count)

    def forward(self, x, y=None):
        m = self.model
        h = m.tok_emb(x) + m.pos_emb(torch.arange(x.shape[1]))
        for block in m.blocks:
            h = block(h) if self.reentrant is None else checkpoint(
                block, h, use_reentrant=self.reentrant)
        logits = m.head(m.lnf(h))
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def test_activation_checkpointing_gives_the_same_values():
    steps = 3
    runs = {}
    for mode in (None, True, False):
        module = gpt(steps, cls=CheckpointedGPT, reentrant=mode)
        mon = monitor()
        fit(module, loader(12, 4), [mon], steps)
        runs[mode] = (mon, module.block_calls)
    plain, calls = runs[None]
    assert calls == 2 * steps
    for mode in (True, False):
        mon, calls = runs[mode]
        # one forward and one recomputation per block and step: the monitor's hooks read no
        # checkpointed tensor during the forward (which would recompute the block there)
        assert calls == 2 * 2 * steps, mode
        assert mon.order == plain.order == NORMS  # the ladder keeps the forward order
        assert [s.rows for s in mon.last_row_stats] == [4 * CONTEXT] * 5  # each row once
        assert mon.meter._tap._pending == []
        # reentrant: the same fast path, bit-identical; non-reentrant: the checkpointed
        # norms are read from their input instead of their saved mean/rstd (1e-6)
        assert_close_history(mon.history, plain.history, exact=mode is True)


def test_resume_has_no_duplicate_or_missing_points(tmp_path):
    """Fit 6 steps, stop, resume from the checkpoint to 10: for every lnmonitor tag the
    points of the two TensorBoard event files, in order, are exactly those of an
    uninterrupted 10-step fit -- including the invariance point at step 6 where the first
    fit validated right after its last checkpoint -- plus, for the ladder, the last step
    of the first fit (each fit's last step is measured) and the ladder positions at the
    resumed fit's first measured step (each fit logs them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = corpus()

    def run(steps, version, ckpt_path=None, callbacks=()):
        L.seed_everything(0, verbose=False)
        data = CharDataModule(text, context=CONTEXT, batch_size=4, max_steps=10, val_windows=8)
        module = TinyGPTModule(data.vocab.chars, width=WIDTH, depth=1, heads=2, context=CONTEXT,
                               max_steps=10)
        cbs = [LayerNormMonitor(every_n_steps=2),
               FinalNormInvarianceMonitor(invariance_every_n_steps=2, on_validation=True, scales=(1.0, 1e-2)),
               *callbacks]
        trainer = L.Trainer(
            accelerator="cpu", max_steps=steps, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=cbs,
            logger=TensorBoardLogger(tmp_path, name="tb", version=version),
            limit_val_batches=1, val_check_interval=3, check_val_every_n_epoch=None,
            enable_checkpointing=bool(callbacks),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)

    def points(version):
        files = sorted((tmp_path / "tb" / version).glob("events.out.tfevents.*"))
        out: dict[str, list] = {}
        for f in files:
            acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                if tag.startswith("lnmonitor/"):
                    out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
        return out, len(files)

    run(10, "full")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_last=True,
                           save_top_k=0)
    run(6, "seg", callbacks=[ckpt])
    run(10, "seg", ckpt_path=tmp_path / "ckpt" / "last.ckpt",
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2")])
    full, _ = points("full")
    seg, n_files = points("seg")
    assert n_files == 2
    assert seg.keys() == full.keys()
    assert [s for s, _ in full["lnmonitor/share_max/model.lnf"]] == [0, 2, 4, 6, 8, 9]
    assert [s for s, _ in full["lnmonitor/invariance/axis_5/dloss"]] == [0, 2, 3, 4, 6, 8, 9, 10]
    for tag, values in full.items():
        expected = [s for s, _ in values]
        if tag.startswith("lnmonitor/ladder_position/"):
            expected = [0, 6]  # each fit's first measured step: a resumed fit's log may be a new one
        elif not tag.startswith("lnmonitor/invariance/"):
            expected = sorted({*expected, 5})  # where the first fit ended
        assert [s for s, _ in seg[tag]] == expected, tag
        # the data stream and optimiser resume too: the same numbers at the same steps
        at = dict(seg[tag])
        np.testing.assert_allclose([at[s] for s, _ in values], [v for _, v in values],
                                   rtol=1e-4, atol=1e-7, err_msg=tag)


class LayerNorm(nn.Module):
    """The hand-written LayerNorm of nanoGPT: weight, optional bias, F.layer_norm with a
    fixed eps inside, and no normalized_shape or eps attribute."""

    def __init__(self, ndim: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
        self._fixed = eps  # not an attribute lnmonitor reads

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self._fixed)


class RMSNorm(nn.Module):
    """A LLaMA-style hand-written RMSNorm: weight and eps attributes, no normalized_shape."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def swap_norms(module: TinyGPTModule, make) -> TinyGPTModule:
    """Replace every nn.LayerNorm of the tiny GPT by ``make(width)`` (gains uniform in
    [0.5, 1.5] where there is one, so that the gain matters)."""
    g = torch.Generator().manual_seed(1)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm):
                new = make(WIDTH)
                if getattr(new, "weight", None) is not None:
                    with torch.no_grad():
                        new.weight.copy_(torch.rand(WIDTH, generator=g) + 0.5)
                setattr(parent, name, new)
    return module


OTHER_NORMS = {
    "nn.RMSNorm": (lambda d: nn.RMSNorm(d, eps=1e-5), "rms"),
    "handwritten_rms": (lambda d: RMSNorm(d), "rms"),
    "handwritten_ln_bias": (lambda d: LayerNorm(d, bias=True), "layer"),
    "handwritten_ln_nobias": (lambda d: LayerNorm(d, bias=False), "layer"),
    "no_gain": (lambda d: nn.LayerNorm(d, elementwise_affine=False), "layer"),
}


@pytest.mark.parametrize("variant", list(OTHER_NORMS))
def test_other_norms_against_float64(variant, caplog):
    make, kind = OTHER_NORMS[variant]
    module = swap_norms(gpt(2), make)
    before = copy.deepcopy(module)
    train = loader(8, 4)
    batch = next(iter(train))
    mon = monitor()
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False, keep_history=True,
                                     probe_batch=windows(2, seed=1), scales=())
    with caplog.at_level(logging.INFO):
        fit(module, train, [mon, inv], 1)
    assert [n.kind for n in mon.norms] == [kind] * 5
    h = mon.history[0]
    check_against_reference(h, float64_reference(before, batch))
    k = 2 if kind == "layer" else 1  # RMSNorm: one dead direction, baseline with k = 1
    assert h["lnmonitor/share_baseline/median"] == pytest.approx(random_baseline.share_median(WIDTH, k))
    assert h["lnmonitor/share_baseline/max"] == pytest.approx(
        random_baseline.max_share_median(WIDTH, k, 4 * CONTEXT))
    said = [r.getMessage() for r in caplog.records if "has no eps attribute" in r.getMessage()]
    if variant.startswith("handwritten_ln"):  # eps measured from the module's output, and said
        assert len(said) == 2 and "measured from its output, is 1e-05" in said[0]
        assert all(n.eps_measured and n.eps() == 1e-5 for n in mon.norms)
    else:
        assert said == []
    shift = inv.history[0]["lnmonitor/invariance/shift_5/dloss"]
    assert (shift == 0.0) if kind == "layer" else (shift != 0.0)  # RMSNorm: not shift-invariant
    assert abs(inv.history[0]["lnmonitor/invariance/axis_5/dloss"]) > 0


class T5LayerNorm(nn.Module):
    """Named a LayerNorm, computes an RMSNorm (T5's: no centring)."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.variance_epsilon = eps

    def forward(self, h):
        return self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class GemmaRMSNorm(RMSNorm):
    """Gain 1 + weight, as Gemma's: found with that gain, never measured as a norm of weight."""

    def forward(self, x):
        return super().forward(x) / self.weight * (1.0 + self.weight)


def test_handwritten_norms_are_told_apart_by_their_output():
    """Found by class name, kept only if the forward computes that norm of its weight: the
    kind is the one the output matches and a missing eps is measured (even 1e-12), so a
    hand-written norm with eps=0.1 hard-coded is measured exactly like nn.LayerNorm(eps=0.1);
    a norm of 1 + weight is found with that gain (its output says so), never with weight."""
    cases = [(LayerNorm(8, eps=0.1), "layer", 0.1), (LayerNorm(8, bias=False, eps=1e-12), "layer", 1e-12),
             (T5LayerNorm(8), "rms", 1e-6), (RMSNorm(8, eps=3e-4), "rms", 3e-4)]
    for module, kind, eps in cases:
        info = describe_norm(module)
        assert (info.kind, info.eps()) == (kind, eps), type(module).__name__
        assert info.eps_measured == isinstance(module, LayerNorm)
    gemma = GemmaRMSNorm(8)
    with torch.no_grad():
        gemma.weight.uniform_(0.5, 1.5)
    info = describe_norm(gemma)
    assert info.kind == "rms" and torch.equal(info.gain(), 1.0 + gemma.weight)

    make = lambda d: LayerNorm(d, eps=0.1)  # noqa: E731
    hand = monitor()
    fit(swap_norms(gpt(2), make), loader(8, 4), [hand], 1)
    same = monitor()
    fit(swap_norms(gpt(2), lambda d: nn.LayerNorm(d, eps=0.1)), loader(8, 4), [same], 1)
    assert_close_history(hand.history, same.history, exact=True)
    assert hand.history[0]["lnmonitor/eps_over_var/model.lnf"] > 0.01  # eps = 0.1 shows
    # stating it: register_norm takes the value itself for a forward that hard-codes it
    register_norm(LayerNorm, "layer", eps=0.1, weight="weight")
    try:
        info = find_norms(swap_norms(gpt(1), make))[0]
        assert not info.eps_measured and info.eps() == 0.1
    finally:
        unregister_norm(LayerNorm)
    with pytest.raises(ValueError):
        register_norm(LayerNorm, "layer", eps=-1.0)
    with pytest.raises(TypeError):
        register_norm(LayerNorm, "layer", eps=[1e-5])


class InjectGrad(torch.autograd.Function):
    """Identity forward; the backward writes ``value`` into the gradient of ``rows``."""

    @staticmethod
    def forward(ctx, y, rows, value):
        ctx.rows, ctx.value = rows, value
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[:, ctx.rows] = ctx.value
        return g, None, None


class FaultModule(L.LightningModule):
    """Rows (batch, 6, d) through one norm; at ``fault_step`` a fault hits ``rows``.  The
    norm's gain is frozen and the input is a leaf, so that the injected NaN reaches no
    parameter: training itself stays healthy, only the monitor sees the bad rows."""

    R, D = 6, 16

    def __init__(self, kind: str, fault: str, rows, fault_step: int = 1):
        super().__init__()
        self.norm = nn.LayerNorm(self.D) if kind == "layer" else nn.RMSNorm(self.D, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
        self.norm.requires_grad_(False)
        self.lin = nn.Linear(self.D, 3)
        self.fault, self.rows, self.fault_step = fault, list(rows), fault_step

    def training_step(self, batch, batch_idx):
        (x,) = batch
        x = x.clone()
        bad = self.trainer.global_step == self.fault_step
        if bad and self.fault == "nan_activation":
            x[:, self.rows] = float("nan")
        x.requires_grad_(True)
        y = self.norm(x)
        if bad and self.fault in ("nan_gradient", "inf_gradient"):
            y = InjectGrad.apply(y, self.rows, float("nan" if self.fault == "nan_gradient" else "inf"))
        keep = torch.ones(self.R, 1)
        if bad and self.fault in ("nan_activation", "zero_gradient"):
            keep[self.rows] = 0.0  # mask after the norm: the loss stays finite
        y = torch.where(keep > 0, y, 0.0)
        return self.lin(y).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    @classmethod
    def data(cls, batch=4, n=12):
        return DataLoader(TensorDataset(torch.randn(n, cls.R, cls.D)), batch_size=batch)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "fault,rows",
    [("nan_activation", [1, 4]), ("nan_gradient", [2]), ("inf_gradient", [0, 5]),
     ("zero_gradient", [3]), ("nan_gradient", list(range(6)))],
    ids=["nan_activation", "nan_gradient", "inf_gradient", "zero_gradient_row", "nan_gradient_all"],
)
def test_a_fault_in_one_step_is_counted_and_training_goes_on(kind, fault, rows):
    module = FaultModule(kind, fault, rows)
    mon = monitor()
    trainer, _ = fit(module, FaultModule.data(), [mon], 3)
    assert trainer.global_step == 3
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert [h["step"] for h in mon.history] == [0, 1, 2]
    zero = fault == "zero_gradient"  # no fault: a row without gradient, counted apart
    for h in mon.history:
        skipped, bad = h["lnmonitor/skipped_rows/norm"], (4 * len(rows) if h["step"] == 1 else 0)
        assert skipped == (0 if zero else bad)
        assert h["lnmonitor/zero_grad_rows/norm"] == (bad if zero else 0)
        skipped += h["lnmonitor/zero_grad_rows/norm"]
        if skipped < 4 * FaultModule.R:
            assert 0.0 < h["lnmonitor/share_median/norm"] <= h["lnmonitor/share_max/norm"] <= 1.0
        else:  # every row bad: no share at all rather than a made-up one
            assert "lnmonitor/share_median/norm" not in h and "lnmonitor/share_max/norm" not in h
        assert math.isfinite(h["lnmonitor/sigma/norm"])
    assert mon.meter._tap._pending == [] and mon.meter._tap._calls_kept == []


class Ragged(Dataset):
    """Batches of different sizes and sequence lengths (batch_size=None loader)."""

    SHAPES = [(4, 16), (3, 9), (4, 5), (2, 16)]

    def __len__(self):
        return len(self.SHAPES)

    def __getitem__(self, i):
        b, t = self.SHAPES[i]
        g = torch.Generator().manual_seed(i)
        return (torch.randint(0, len(VOCAB), (b, t), generator=g),
                torch.randint(0, len(VOCAB), (b, t), generator=g))


def test_batches_of_varying_length():
    """Micro-batches of varying size and length, two per optimizer step: every row of
    both is measured and the values are those of each step's rows."""
    mon = monitor()
    rows = []

    class Rows(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx % 2 == 1:
                rows.append([s.rows for s in mon.last_row_stats])

    trainer, _ = fit(gpt(2, depth=1), DataLoader(Ragged(), batch_size=None), [mon, Rows()], 2,
                     accumulate_grad_batches=2)
    assert trainer.global_step == 2
    assert rows == [[4 * 16 + 3 * 9] * 3, [4 * 5 + 2 * 16] * 3]
    for h in mon.history:
        assert all(v == 0 for k, v in h.items() if "skipped" in k)
        assert all(math.isfinite(v) for v in h.values())


def test_validation_free_fit():
    """No validation data: LayerNormMonitor measures; the invariance monitor probes the
    first training batch (and says so); a monitor that only runs after validation, and
    StructureProbe, say that they never ran instead of staying silent."""
    ln = monitor()
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=2, keep_history=True, scales=())
    after_val = FinalNormInvarianceMonitor(invariance_every_n_steps=None, on_validation=True,
                                           keep_history=True)
    probe = StructureProbe()
    trainer, caught = fit(gpt(3), loader(12, 4), [ln, inv, after_val, probe], 3,
                          limit_val_batches=1.0)  # Lightning's default: there is just no data
    assert trainer.global_step == 3
    assert [h["step"] for h in ln.history] == [0, 1, 2]
    assert [h["step"] for h in inv.history] == [0, 2, 3]  # 3: the point after the last update
    assert sum("probes the first training batch" in w for w in caught) == 1
    assert after_val.history == []
    assert sum("FinalNormInvarianceMonitor never ran" in w for w in caught) == 1
    assert sum("StructureProbe never ran" in w for w in caught) == 1
    assert probe.last is None


def test_a_norm_the_forward_never_calls_is_reported_once():
    module = gpt(3, depth=1)
    module.model.spare = nn.LayerNorm(WIDTH)  # found by discovery, never called
    mon = monitor()
    _, caught = fit(module, loader(12, 4), [mon], 3)
    said = [w for w in caught if "did not run with gradient" in w]
    assert len(said) == 1 and "1 of the 4 selected norms" in said[0] and "model.spare" in said[0]
    assert all("lnmonitor/share_median/model.spare" not in h for h in mon.history)
    assert all("lnmonitor/share_median/model.lnf" in h for h in mon.history)


DDP_SCRIPT = Path(__file__).with_name("ddp_uneven_script.py")


@pytest.mark.slow
def test_ddp_uneven_last_batch(tmp_path):
    """Real 2-process gloo DDP; rank 1's last training batch (and its validation data)
    is shorter: no hang (subprocess timeout), the rows of the global batch add up, the
    fit completes on both ranks."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), str(out)], env=env, cwd=DDP_SCRIPT.parent.parent,
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    for rank in (0, 1):  # both ranks finished the fit
        assert json.loads(Path(f"{out}.rank{rank}").read_text()) == {"step": 2}
    per_step = {int(k): v for k, v in result["rows"].items()}
    assert per_step == {0: [(4 + 4) * 16] * 3, 1: [(4 + 3) * 16] * 3}
    assert [h["step"] for h in result["history"]] == [0, 1]
    assert all(h["lnmonitor/skipped_rows/model.lnf"] == 0 for h in result["history"])
    assert result["invariance_steps"] == [0, 1, 2]
