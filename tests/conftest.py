"""What the tests share: tiny models and data, quiet Trainers, the float64 references the
monitors are checked against, TensorBoard read-back and a free port.

Test modules import these with ``from conftest import ...`` (``tests/`` is on the path).
Models are tiny (width 16-64, depth 1-2, context 16) so that the suite runs in minutes
on two cores.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import socket
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lnmonitor import LayerNormMonitor, StructureProbe
from lnmonitor.core.meter.row_stats import SHARE_RESOLUTION, SIGMA_RESOLUTION
from lnmonitor.core.meter.taps import NormTap
from lnmonitor.core.norms.find import find_norms
from lnmonitor.tiny import CharDataModule, TinyGPTModule, load_corpus
from lnmonitor.tiny.checkpoint import load_checkpoint
from lnmonitor.tiny.train import Recipe
from lnmonitor.tiny.train import fit as fit_recipe

VOCAB = "".join(chr(c) for c in range(32, 97))  # 65 symbols
WIDTH, CONTEXT = 32, 16
NORMS = ["model.blocks.0.ln1", "model.blocks.0.ln2", "model.blocks.1.ln1", "model.blocks.1.ln2",
         "model.lnf"]  # the norms of gpt(depth=2), in forward order

_TEXT: list[str] = []

# Lightning stops its logger propagating when it is imported before the root logger has a
# handler, as here, where conftest is loaded before pytest captures logs: let caplog see it.
logging.getLogger("lightning.pytorch").propagate = True


# ---------------------------------------------------------------------------
# models and data
# ---------------------------------------------------------------------------


def windows(n: int, seed: int = 0, context: int = CONTEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random token windows and targets over :data:`VOCAB`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, len(VOCAB), (n, context), generator=g),
            torch.randint(0, len(VOCAB), (n, context), generator=g))


def loader(n: int, batch: int, seed: int = 0) -> DataLoader:
    return DataLoader(TensorDataset(*windows(n, seed)), batch_size=batch, shuffle=False)


def gpt(steps: int = 10, seed: int = 0, depth: int = 2, cls=TinyGPTModule, width: int = WIDTH, **kw):
    """A tiny :class:`TinyGPTModule` with seeded random weights (``cls`` for a subclass)."""
    torch.manual_seed(seed)
    return cls(VOCAB, width=width, depth=depth, heads=2, context=CONTEXT, max_steps=steps, **kw)


def corpus() -> str:
    """The first 40,000 characters of the default corpus (read once)."""
    if not _TEXT:
        _TEXT.append(load_corpus()[:40_000])
    return _TEXT[0]


def char_data(steps: int, seed: int = 0, batch: int = 4, **kw):
    """``(datamodule, module)``: the recipe's data on :func:`corpus` (8 validation windows)
    and a tiny module over its vocabulary."""
    L.seed_everything(seed, verbose=False)
    data = CharDataModule(corpus(), context=CONTEXT, batch_size=batch, max_steps=steps, val_windows=8)
    module = TinyGPTModule(data.vocab.chars, width=WIDTH, depth=2, heads=2, context=CONTEXT,
                           max_steps=steps, **kw)
    return data, module


# ---------------------------------------------------------------------------
# Trainers
# ---------------------------------------------------------------------------


def trainer(steps: int, callbacks=(), validate_every: int | None = None, **kw) -> L.Trainer:
    """A quiet CPU Trainer: no logger, progress bar, summary, checkpointing or sanity check;
    with ``validate_every``, one validation batch every that many optimizer steps."""
    args = dict(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )
    if validate_every is not None:
        args.update(limit_val_batches=1, val_check_interval=validate_every, check_val_every_n_epoch=None)
    args.update(kw)
    return L.Trainer(**args)


def fit(module, train, callbacks, steps, val=None, ckpt_path=None, **kw):
    """Fit on a quiet Trainer (no validation unless ``val`` is given); returns
    ``(trainer, warning messages)``."""
    if val is None and "limit_val_batches" not in kw:
        kw["limit_val_batches"] = 0
    t = trainer(steps, callbacks, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    return t, [str(w.message) for w in caught]


def monitor(**kw) -> LayerNormMonitor:
    """A LayerNormMonitor that measures every step and keeps its history."""
    return LayerNormMonitor(**{"every_n_steps": 1, "keep_history": True, **kw})


# ---------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------


def qr_share(x: np.ndarray, w: np.ndarray, kind: str = "layer") -> np.ndarray:
    """Dead-plane share per row: ``|Q^T w| / |w|`` with Q from an explicit QR of
    ``[1, x - mean]`` (LayerNorm) or ``[x]`` (RMSNorm)."""
    out = []
    for xr, wr in zip(x, w, strict=True):
        if kind == "layer":
            a = np.stack([np.ones_like(xr), xr - xr.mean()], axis=1)
        else:
            a = xr[:, None]
        q, _ = np.linalg.qr(a)
        out.append(np.linalg.norm(q.T @ wr) / np.linalg.norm(wr))
    return np.array(out)


def float64_reference(module, batch, state=None, loss_fn=None) -> dict[str, dict]:
    """An independent float64 recomputation of one step for every norm lnmonitor finds in
    ``module`` (with the weights ``state`` when given): per norm the share of
    ``gain * dL/dy`` by QR (k = 2 for LayerNorm-like, 1 for RMSNorm-like), the norm's
    variance (mean square for RMS), the stream's mean square, its eps and kind."""
    ref = copy.deepcopy(module)
    if state is not None:
        ref.load_state_dict(state)
    ref = ref.double()
    found: dict[str, list] = {}
    infos = find_norms(ref)
    for info in infos:
        def hook(m, a, o, name=info.name):
            found[name] = [a[0].detach()]
            o.register_hook(lambda g, name=name: found[name].append(g.detach()))
        info.module.register_forward_hook(hook)
    loss = (loss_fn or (lambda m, b: m(*b)[1]))(ref, batch)
    loss.backward()
    out = {}
    for info in infos:
        x, g = found[info.name]
        d = x.shape[-1]
        x, g = x.reshape(-1, d).numpy(), g.reshape(-1, d).numpy()
        weight = info.gain()
        w = g * weight.detach().numpy() if weight is not None else g
        var = x.var(1) if info.kind == "layer" else (x**2).mean(1)
        out[info.name] = dict(share=qr_share(x, w, info.kind), var=var, ms=(x**2).mean(1),
                              kind=info.kind, eps=info.eps(torch.float32), k=info.dead_dim)
    return out


def check_against_reference(logged: dict, ref: dict[str, dict]) -> None:
    """A logged step agrees with :func:`float64_reference` within the histograms' resolution."""
    for name, r in ref.items():
        assert logged[f"lnmonitor/share_max/{name}"] == pytest.approx(r["share"].max(), abs=1e-4), name
        median = logged[f"lnmonitor/share_median/{name}"]
        assert abs(median - np.median(r["share"])) <= SHARE_RESOLUTION + 1e-5, name
        sigma = math.sqrt(np.median(r["var"]) + r["eps"])
        assert logged[f"lnmonitor/sigma/{name}"] == pytest.approx(sigma, rel=SIGMA_RESOLUTION + 1e-5), name
        assert logged[f"lnmonitor/skipped_rows/{name}"] == 0


def assert_close_history(a: list[dict], b: list[dict], exact: bool = False) -> None:
    """Two monitors' histories agree: same steps and keys, values within the histograms'
    resolution (or exactly).  Two empty histories are no agreement: a monitor that went off logs none."""
    assert a and b, "a history to compare is empty"
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for ha, hb in zip(a, b, strict=True):
        assert ha.keys() == hb.keys()
        for key, va in ha.items():
            vb = hb[key]
            if exact:
                assert va == vb, key
            elif "share_median" in key or "share_p90" in key:
                assert abs(va - vb) <= SHARE_RESOLUTION + 1e-6, key
            elif "share_max" in key:
                assert va == pytest.approx(vb, abs=1e-5), key
            else:
                assert va == pytest.approx(vb, rel=2 * SIGMA_RESOLUTION, abs=1e-9), key


# ---------------------------------------------------------------------------
# TensorBoard read-back, ports
# ---------------------------------------------------------------------------


def events(log_dir):
    """An EventAccumulator over ``log_dir`` that keeps every event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0,
                                                        "images": 0})
    acc.Reload()
    return acc


def hparams_columns(log_dir) -> list[str]:
    """The metric columns of a run's HPARAMS session in its order (the first session: TensorBoard's)."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    experiment = events(log_dir).SummaryMetadata("_hparams_/experiment")
    content = plugin_data_pb2.HParamsPluginData.FromString(experiment.plugin_data.content)
    return [m.name.tag for m in content.experiment.metric_infos]


def scalars(acc) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in an EventAccumulator."""
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def fsdp1_units(blocks: torch.nn.ModuleList):
    """Each of ``blocks`` wrapped, in place, in a real FSDP1 unit (``FullyShardedDataParallel`` with
    the original parameters, as Lightning's ``FSDPStrategy`` wraps blocks; it needs CUDA, these run
    on one gloo process)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP's note: NO_SHARD on a world of one
            for i, block in enumerate(blocks):
                blocks[i] = FullyShardedDataParallel(block, device_id=torch.device("cpu"),
                                                     use_orig_params=True)
        yield
    finally:
        dist.destroy_process_group()


def run_script(name: str, out, processes: int, *args) -> dict:
    """``tests/<name> out *args`` in one process, or in ``processes`` under torchrun (gloo, one
    thread each), writing its JSON to ``out``; returns what it wrote (the script's stderr on failure)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name(name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(script.parent), str(script.parent.parent),
                                                        os.environ.get("PYTHONPATH")]))}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
              f"--master_port={free_port()}"] if processes > 1 else [sys.executable]
    proc = subprocess.run([*launch, str(script), str(out), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(Path(out).read_text())


# ---------------------------------------------------------------------------
# loggers and shared fixtures
# ---------------------------------------------------------------------------


class MemoryLogger(Logger):
    """Keeps every logged metric in memory."""

    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


PROBE_WIDTH = 64


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A tiny GPT trained for 60 steps with the probe attached, and its held-out batches."""
    probe = StructureProbe()
    logger = MemoryLogger()
    recipe = Recipe(width=PROBE_WIDTH, depth=2, heads=2, context=32, max_steps=60, val_every=30)
    text = load_corpus()
    result = fit_recipe(recipe, text, tmp_path_factory.mktemp("probe"), callbacks=[probe], logger=logger,
                        progress=False)
    module = load_checkpoint(result.checkpoint)[0]
    data = CharDataModule(text, vocab=module.vocab, context=recipe.context)
    return {"module": module, "batches": data.val_batches()[:2], "probe": probe, "logger": logger}


class Net(nn.Module):
    def __init__(self, d, kind, eps=1e-5):
        super().__init__()
        self.inp = nn.Linear(6, d)
        norm = nn.LayerNorm if kind == "layer" else nn.RMSNorm
        self.n1 = norm(d, eps=eps)
        self.mid = nn.Linear(d, d)
        self.n2 = norm(d, eps=eps)
        self.out = nn.Linear(d, 3)
        with torch.no_grad():
            for n in (self.n1, self.n2):
                n.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = self.inp(x) + 0.7
        h = h + self.mid(torch.nn.functional.gelu(self.n1(h)))
        return self.out(self.n2(3.0 * h))


def run_tap(model, x, dtype=None):
    norms = find_norms(model)
    tap = NormTap(norms)
    captured = {}
    handles = []
    for i, info in enumerate(norms):
        def hook(m, a, o, i=i):
            captured[i] = [a[0].detach()]
            o.register_hook(lambda g, i=i: captured[i].append(g.detach()))
        handles.append(info.module.register_forward_hook(hook))
    tap.attach()
    if dtype is None:
        loss = model(x).square().mean()
    else:
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x).square().mean()
    loss.backward()
    tap.detach()
    for h in handles:
        h.remove()
    return norms, tap.collect(), captured


def whole_and_parts():
    """The tap's rows of a ``Net(24, "layer")`` on one batch of 40 and on its two parts (17 and
    23 rows), as two processes holding one part each would measure them."""
    torch.manual_seed(1)
    model = Net(24, "layer")
    x = torch.randn(40, 6)
    _, whole, _ = run_tap(model, x)
    model.zero_grad()
    _, a, _ = run_tap(model, x[:17])
    _, b, _ = run_tap(model, x[17:])
    return whole, a, b
