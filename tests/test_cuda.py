"""What only a GPU can check, and its CPU half where there is one: the statistics under
mixed precision against float64 of the very tensors the step produced, Lightning's real
CUDA GradScaler (shares independent of the loss scale, overflowing rows skipped and
counted), a compiled model against the eager one, and FSDPStrategy and
ModelParallelStrategy (FSDP2) on one GPU (world size 1 still takes the sharded paths) on
a tiny GPT and a transformers GPT-2.

The CUDA tests are marked ``cuda`` and skip without a device; ``benchmarks/gpu_check.py``
runs them (``pytest -m cuda``) on a GPU machine.
"""

from __future__ import annotations

import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from conftest import CONTEXT, NORMS, assert_close_history, gpt, loader, qr_share
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision
from test_distributed import run as run_script

from lnmonitor import LayerNormMonitor
from lnmonitor.core.invariance.runs import FSDP1_REFUSED
from lnmonitor.core.meter.row_stats import SHARE_RESOLUTION, SIGMA_RESOLUTION

HAS_CUDA = torch.cuda.is_available()
cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]


class Capture(Callback):
    """The input and ``dL/dy`` of every norm in step 0, exactly as the step made them
    (autocast, loss scale and all), moved to the host in float64."""

    def __init__(self) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.gains: dict[str, torch.Tensor] = {}
        self._handles = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 0:
            return
        for name in NORMS:
            norm = pl_module.get_submodule(name)

            def hook(module, args, output, name=name):
                self.inputs[name] = args[0].detach().double().cpu()
                self.gains[name] = module.weight.detach().double().cpu()
                output.register_hook(lambda g, name=name: self.grads.__setitem__(name, g.double().cpu()))

            self._handles.append(norm.register_forward_hook(hook))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def fit_once(accelerator: str, precision: str, plugins=(), steps: int = 1, module=None):
    module = module if module is not None else gpt(steps)
    mon, cap = LayerNormMonitor(every_n_steps=1, keep_history=True), Capture()
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, precision=None if plugins else precision, plugins=list(plugins),
        max_steps=steps, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[cap, mon], limit_val_batches=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(8 * steps, 8))
    return trainer, mon, cap


@pytest.mark.parametrize(("accelerator", "precision"), [
    ("cpu", "bf16-mixed"),
    pytest.param("cuda", "bf16-mixed", marks=cuda),
    pytest.param("cuda", "16-mixed", marks=cuda),
    pytest.param("cuda", "32-true", marks=cuda),
])
def test_statistics_under_mixed_precision_equal_float64_of_the_same_tensors(accelerator, precision):
    _, mon, cap = fit_once(accelerator, precision)
    logged = mon.history[0]
    assert set(cap.grads) == set(NORMS)
    for name in NORMS:
        x = cap.inputs[name].reshape(-1, cap.inputs[name].shape[-1]).numpy()
        w = (cap.grads[name] * cap.gains[name]).reshape(x.shape).numpy()  # the loss scale cancels
        share = qr_share(x, w, "layer")
        assert logged[f"lnmonitor/share_max/{name}"] == pytest.approx(share.max(), abs=2e-4), name
        assert abs(logged[f"lnmonitor/share_median/{name}"] - np.median(share)) <= SHARE_RESOLUTION + 2e-4
        sigma = math.sqrt(np.median(x.var(1)) + 1e-5)
        assert logged[f"lnmonitor/sigma/{name}"] == pytest.approx(sigma, rel=SIGMA_RESOLUTION + 1e-4), name
        assert logged[f"lnmonitor/skipped_rows/{name}"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_lightnings_cuda_grad_scaler_loss_scale_cancels_and_overflow_is_skipped():
    def run(init_scale, steps=2):
        scaler = torch.amp.GradScaler("cuda", init_scale=init_scale, growth_interval=10_000)
        trainer, mon, _ = fit_once("cuda", "16-mixed", [MixedPrecision("16-mixed", "cuda", scaler)], steps)
        assert trainer.global_step == steps  # training goes on
        return mon, scaler

    big, _ = run(2.0**16)
    small, _ = run(2.0**8)
    assert_close_history(big.history[:1], small.history[:1])
    over, scaler = run(2.0**40)
    assert scaler.get_scale() < 2.0**40 and over.history
    for h in over.history:
        for name in NORMS:
            assert h[f"lnmonitor/skipped_rows/{name}"] == 8 * CONTEXT
            assert f"lnmonitor/share_median/{name}" not in h and math.isfinite(h[f"lnmonitor/sigma/{name}"])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_compiled_model_on_cuda_logs_what_the_eager_model_logs():
    _, eager, _ = fit_once("cuda", "32-true", steps=2)
    compiled = gpt(2)
    compiled.model = torch.compile(compiled.model)
    _, mon, _ = fit_once("cuda", "32-true", steps=2, module=compiled)
    assert_close_history(mon.history, eager.history)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("model", ["tiny", "gpt2"])
@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_sharded_on_one_gpu_matches_the_plain_run(strategy, model, tmp_path):
    plain = run_script("ddp", 1, tmp_path / "plain.json", "cuda", model)
    sharded = run_script(strategy, 1, tmp_path / "sharded.json", "cuda", model)
    assert sharded["off"] is None and sharded["rows"] == plain["rows"]
    assert_close_history(sharded["history"], plain["history"])
    if strategy == "fsdp1":  # the probe refuses FSDP1 and says why; the fit and the ladder go on
        assert sharded["disabled"] == FSDP1_REFUSED and not sharded["invariance"]
        return
    assert sharded["disabled"] is None
    first, ref = sharded["invariance"][0], plain["invariance"][0]
    assert first.keys() == ref.keys()
    for key, value in first.items():
        assert value == pytest.approx(ref[key], rel=1e-3, abs=1e-5), key


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ["tp", "tp-replicated"])
def test_tensor_parallel_on_cuda_matches_the_plain_run(strategy, tmp_path):
    # ModelParallelStrategy's tensor parallelism on min(2, GPUs) GPUs (NCCL runs one rank per
    # device: with one GPU the plan lays the model out on a mesh of one rank, which still makes
    # every norm's input, output and gradient a CUDA DTensor); rows, figures and the probe are
    # the plain run's
    devices = min(2, torch.cuda.device_count())
    plain = run_script("ddp", 1, tmp_path / "plain.json", "cuda")
    tp = run_script(strategy, devices, tmp_path / "tp.json", "cuda")
    assert tp["off"] is None and tp["disabled"] is None and tp["rows"] == plain["rows"]
    assert_close_history(tp["history"], plain["history"])
    first, ref = tp["invariance"][0], plain["invariance"][0]
    assert first.keys() == ref.keys()
    for key, value in first.items():
        if key.endswith("log10_abs_dloss"):  # |dloss| itself: one ulp of the loss is 0.3 in its log
            value, ref[key] = 10.0**value, 10.0**ref[key]
        assert value == pytest.approx(ref[key], rel=1e-3, abs=1e-5), key
