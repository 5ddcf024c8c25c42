"""Cost of the monitors: step time and peak memory, side by side in one run.

Every figure is a ratio between fits of the same recipe (``lnmonitor.tiny.train.fit``,
TensorBoard logger, no progress bar, the same batches) run in one process, interleaved
round by round in rotated order so that load from other processes hits all alike.  A
callback stamps each batch start (after ``torch.cuda.synchronize()`` on a GPU); a step's
time is the gap to the next stamp (forward, backward, optimizer, every callback and
logging).  Reported: medians over rounds of per-round ratios.

Configurations of one model:

* ``plain``: no monitor;  ``every``: ``LayerNormMonitor(every_n_steps=1)``;
* ``alternate``: ``LayerNormMonitor(every_n_steps=2)``: its *paired* ratio is the median
  over measured steps of the measured step / the mean of its two unmeasured neighbours,
  the same ratio from steps a few hundred ms apart, far less exposed to other load;
* ``defaults``: both monitors at their defaults (the recipe logs every 50 steps; the
  invariance probe runs every 1000 steps).  A short fit cannot hold 50 or 1000 steps of
  every width, so the defaults' cost is amortised from parts measured directly:
  ``1 + (t_idle + (paired - 1) t_plain / 50 + t_probe / 1000) / t_plain`` with
  ``t_idle`` the time inside the two monitors' Lightning hooks on a step where neither
  measures and ``t_probe`` the wall time of one periodic invariance run (not the first,
  whose one-time checks are a fixed cost per fit).

Rows: the main table (``--widths``, depth 4; ``--gpt2`` adds the GPT-2 of
examples/transformers_causal_lm.py, a transformers model without a ``forward``, fitted as
that example fits it);
``--compile``: the same model with its inner ``nn.Module`` compiled in place
(``module.model.compile()``), against the compiled model unmonitored (the measured steps
run eagerly, see LayerNormMonitor); ``--peers``: Lightning's ``grad_norm`` utility
logged every step and ``wandb.watch(log="all", log_freq=1)`` offline, every step, next
to ``LayerNormMonitor(every_n_steps=1)`` (``pip install -e ".[bench]"``).

Fixed costs per fit (main table): the wall time inside the monitors' ``setup`` and
``on_fit_start`` (fit start: discovery, the float64 self-check, hparams; for the
invariance monitor also its first run's one-time checks, see :class:`TimedProbe`) and
``on_train_end`` (fit end: the last invariance run, the heatmap picture, the summaries),
ms per monitor, from the ``every`` and ``defaults`` fits above (the monitors at their
defaults: pictures and summaries on).

The cost model (``--sweep``): every width of ``--sweep-widths`` x depth of ``--depths``,
context and batch as above, each cell a TinyGPT stepped in a plain loop without Lightning
with a ``LadderMeter`` on alternate steps (:func:`loop_cell` says exactly what is timed):
the measured step's extra time (paired, as ``alternate``), that extra as a fraction of a
training step, and the defaults' amortised ratio (the formula above, with one invariance
run timed in the cell and the main table's idle hook time); exponents of the extra time
fitted against rows x width and the norm count, and a PNG of the extra fraction against
width (``--figure``).  Cells run the least work first; a cell is skipped, and the table
says why, when its estimated memory exceeds ``--sweep-memory`` or its time, estimated from
the largest cell measured before it, exceeds ``--cell-budget`` even at the fewest steps
(the steps are cut to the budget before that).

The small rows (``--small``): the shapes a new user's first runs have, stepped in a plain loop
with the plain-loop door (``LoopMonitor``), as nanoGPT's ``train.py`` steps: nanoGPT's smallest
shape (a TinyGPT of 2 layers, width 64, 4 heads, batch 12, context 64: nanoGPT's own model
differs in biases and dropout) and the tiny model (4 layers) at widths 64 and 128 (batch and
context of the main table).  Per row, four loops of the same model (a copy of one
initialisation) on the same batches, interleaved step by step in rotated order: ``plain``,
``every`` (``LoopMonitor(every_n_steps=1)``, no probe, pictures or summary), ``defaults``
(``LoopMonitor()`` with its defaults, no probe batch: it measures step 0 and then every 50th)
and ``quiet`` (the defaults with ``findings=False``: no every-step growth watch).
Reported: the measured step against a plain one (medians), the defaults amortised over 50
steps (``(t_defaults_unmeasured + (t_every - t_plain) / 50) / t_plain``), the same with
``findings=False`` (the every-step watch's share is the difference), the import time of
the loop door after torch (median of 3 fresh interpreters) and the peak bytes of one
measured step against one plain step (as below).

Memory: one measured step of ``plain``, ``every`` and ``defaults`` (both monitors firing)
is recorded with ``torch.profiler`` (``profile_memory=True``) and its allocation timeline
replayed: the peak is the maximum over the step of the bytes allocated since it began and
not yet freed.  On CUDA, ``torch.cuda.max_memory_allocated`` over the step.

    python benchmarks/overhead.py --widths 128 512 1024 --steps 12 --rounds 3 --threads 2 \\
        --gpt2 --compile --peers --markdown overhead.md
    python benchmarks/overhead.py --widths --sweep --threads 2 --markdown cost_model.md
    python benchmarks/overhead.py --widths --small --steps 60 --threads 1 --markdown small.md
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.integrations.loop import LoopMonitor
from lnmonitor.lightning import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit

LN_CADENCE = 50  # the recipe's and the GPT-2 example's log_every_n_steps
PROBE_CADENCE = FinalNormInvarianceMonitor().every_n_steps  # its default: every 1000 steps
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 65  # the corpus's characters: the cost model's vocabulary
HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)
FIT_START = ("setup", "on_fit_start")  # discovery, the float64 self-check, hparams
FIT_END = ("on_train_end",)  # the last invariance run, the heatmap picture, the summary


class StepTimer(Callback):
    def __init__(self, sync: bool) -> None:
        self.sync, self.starts = sync, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())


class CompileInner(Callback):
    """Compile the LightningModule's inner model in place (its module names unchanged)."""

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.model.compile()


class TimedProbe(FinalNormInvarianceMonitor):
    """The default invariance monitor, with the wall time of each periodic run (the five
    cases, no sweep) recorded; the end of the fit's sweep is a fixed cost per fit.  The first
    run also does the one-time checks (finding the final norm and the probe's loss, the
    gradient pass that checks the norm is final): each periodic run is timed once more right
    after it (``run_seconds``, logging nothing) and the first's surplus is ``setup_seconds``,
    a fixed cost per fit."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.run_seconds: list[float] = []
        self.setup_seconds = 0.0

    def _run(self, trainer, pl_module, step, sweep) -> None:
        before = self.last_result
        t0 = time.perf_counter()
        super()._run(trainer, pl_module, step, sweep)
        spent = time.perf_counter() - t0
        if self.last_result is before or sweep:
            return
        probe = self._get_probe(trainer, pl_module)
        t0 = time.perf_counter()
        self._prober.run(probe, sweep=False)
        self.run_seconds.append(time.perf_counter() - t0)
        if len(self.run_seconds) == 1:
            self.setup_seconds = max(0.0, spent - self.run_seconds[0])


class GradNormEveryStep(Callback):
    """Lightning's ``grad_norm`` utility (every parameter's 2-norm) logged every step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm

        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


class WandbWatch(Callback):
    """``wandb.watch(model, log="all", log_freq=1)`` on an offline run."""

    def setup(self, trainer, pl_module, stage) -> None:
        if stage != "fit":
            return
        import wandb

        self._dir = tempfile.TemporaryDirectory()
        self.run = wandb.init(mode="offline", dir=self._dir.name, project="lnmonitor-bench")
        wandb.watch(pl_module, log="all", log_freq=1)

    def teardown(self, trainer, pl_module, stage) -> None:
        if stage == "fit":
            self.run.unwatch(pl_module)  # its hooks would outlive the run otherwise
            self.run.finish()
            self._dir.cleanup()


class StepMemory(Callback):
    """Peak bytes allocated during step ``step`` (see the module docstring)."""

    def __init__(self, step: int) -> None:
        self.step, self.peak = step, None
        self._prof = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self._prof is not None:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            self._prof = "cuda"
            return
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=True, with_stack=True)
        self._prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._prof is None or self.peak is not None or trainer.global_step == self.step:
            return
        if self._prof == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
            return
        self._prof.__exit__(None, None, None)
        from torch.profiler._memory_profiler import Action, MemoryProfile

        live = peak = 0
        for _, action, _, size in MemoryProfile(self._prof.profiler.kineto_results).timeline:
            if action == Action.CREATE:
                live += size
            elif action == Action.DESTROY:
                live -= size
            peak = max(peak, live)
        self.peak = peak


def time_hooks(callback: Callback, sink: dict, hooks: tuple[str, ...] = HOOKS, key: str | None = None,
               ) -> None:
    """Wrap the callback's ``hooks``; ``sink[key]`` accumulates the seconds spent inside them
    (``key`` None: the trainer's global step, one entry per step)."""
    for name in hooks:
        method = getattr(callback, name)

        def timed(trainer, *args, _method=method, **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(trainer, *args, **kwargs)
            finally:
                where = trainer.global_step if key is None else key
                sink[where] = sink.get(where, 0.0) + time.perf_counter() - t0

        setattr(callback, name, timed)


def callbacks_for(config: str, cadence: int | None = None) -> list[Callback]:
    """The callbacks of a configuration (``cadence`` forces both default monitors to fire)."""
    if config == "every":
        return [LayerNormMonitor(every_n_steps=1)]
    if config == "alternate":
        return [LayerNormMonitor(every_n_steps=2)]
    if config == "defaults":
        if cadence is None:
            return [LayerNormMonitor(), TimedProbe()]
        return [LayerNormMonitor(every_n_steps=cadence), TimedProbe(every_n_steps=cadence)]
    if config == "grad_norm":
        return [GradNormEveryStep()]
    if config == "wandb_watch":
        return [WandbWatch()]
    return []  # plain


def fitter(model: str, width: int, depth: int, steps: int, args, text: str) -> Callable[[list], None]:
    """A function that fits the benchmarked model once, from its seed, with the given callbacks:
    the train-tiny recipe (``tiny``) or the GPT-2 of examples/transformers_causal_lm.py
    (``gpt2``: width 128, 4 layers, no ``forward``, as the example fits it)."""
    if model == "gpt2":
        return lambda callbacks: fit_gpt2_example(steps, args, callbacks)
    recipe = Recipe(width=width, depth=depth, heads=4, context=args.context, max_steps=steps,
                    batch_size=args.batch_size, val_every=max(steps + 1, 250), seed=0,
                    trainer_kwargs={"limit_val_batches": 1, "accelerator": args.device})

    def run(callbacks: list) -> None:
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logger = TensorBoardLogger(folder, name="bench", default_hp_metric=False)
            fit(recipe, text, folder, logger=logger, callbacks=callbacks, progress=False, resume=False)

    return run


def fit_gpt2_example(steps: int, args, callbacks: list) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from transformers_causal_lm import build
    finally:
        sys.path.remove(str(EXAMPLES))
    module, train, val = build("gpt2", args.context, args.batch_size)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            max_steps=steps, logger=TensorBoardLogger(folder, name="bench", default_hp_metric=False),
            callbacks=callbacks, accelerator=args.device, devices=1, log_every_n_steps=LN_CADENCE,
            val_check_interval=steps + 1, check_val_every_n_epoch=None, limit_val_batches=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(module, train, val)


def gaps(starts: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(starts[warmup:], starts[warmup + 1 :], strict=False)]


def paired(alternate: list[float], warmup: int) -> float:
    """Measured / mean of unmeasured neighbours, median over the measured (even) steps."""
    first = 0 if warmup % 2 == 0 else 1  # gap i is step warmup + i
    return statistics.median(
        alternate[i] / ((alternate[i - 1] + alternate[i + 1]) / 2)
        for i in range(first or 2, len(alternate) - 1, 2)
    )


@dataclass
class ModelResult:
    """Per-round figures of one model (lists over rounds; medians are reported)."""

    width: int
    depth: int
    compiled: bool = False
    model: str = "tiny"
    plain_ms: list[float] = field(default_factory=list)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.ratios.setdefault(key, []).append(value)

    def median(self, key: str) -> float:
        values = self.ratios.get(key)
        return statistics.median(values) if values else math.nan


def bench(width: int, depth: int, configs: tuple[str, ...], args, text: str, compiled: bool = False,
          memory: bool = False, model: str = "tiny") -> ModelResult:
    """Interleaved rounds of fits of one model, one per configuration."""
    run_fit = fitter(model, width, depth, args.steps, args, text)
    res = ModelResult(width, depth, compiled, model)
    sync = args.device == "cuda"
    extra = [CompileInner()] if compiled else []
    for rnd in range(args.rounds):
        runs = {}
        k = rnd % len(configs)
        for config in configs[k:] + configs[:k]:  # rotate who goes first
            timer, cbs, inside = StepTimer(sync), callbacks_for(config), {}
            fixed = [{} for _ in cbs]
            for cb, spent in zip(cbs, fixed, strict=True):
                if config == "defaults":
                    time_hooks(cb, inside)
                time_hooks(cb, spent, FIT_START, "start")
                time_hooks(cb, spent, FIT_END, "end")
            run_fit([*extra, *cbs, timer])
            for cb, spent in zip(cbs, fixed, strict=True):
                spent["start"] = spent.get("start", 0.0) + getattr(cb, "setup_seconds", 0.0)
            runs[config] = (gaps(timer.starts, args.warmup), cbs, inside, fixed)
        plain = statistics.median(runs["plain"][0])
        res.plain_ms.append(1000 * plain)
        line = [f"{'compiled ' if compiled else ''}width {width} depth {depth} round {rnd + 1}: "
                f"plain {1000 * plain:.1f} ms"]
        for config in configs:
            if config in ("plain", "alternate", "defaults"):
                continue
            res.add(config, statistics.median(runs[config][0]) / plain)
            line.append(f"{config} x{res.ratios[config][-1]:.3f}")
        if "alternate" in runs:
            res.add("paired", paired(runs["alternate"][0], args.warmup))
            res.add("measured_extra_ms", 1000 * (res.ratios["paired"][-1] - 1) * plain)
            line.append(f"paired x{res.ratios['paired'][-1]:.3f}")
        if "defaults" in runs:
            steps, cbs, inside, _ = runs["defaults"]
            probe = cbs[1].run_seconds
            t_probe = probe[-1] if probe else 0.0
            # steps whose hooks all lie in the run, excluding step 0 where both monitors run
            idle = statistics.median(inside[s] for s in range(args.warmup + 1, args.steps - 1))
            measured = res.ratios["paired"][-1] - 1 if "paired" in res.ratios else 0.0
            res.add("unmeasured", statistics.median(steps) / plain)
            res.add("idle_us", 1e6 * idle)
            res.add("probe_ms", 1000 * t_probe)
            probe_part = t_probe / PROBE_CADENCE / plain
            res.add("defaults", 1 + (idle + measured * plain / LN_CADENCE) / plain + probe_part)
            res.add("probe_part", probe_part)
            line.append(f"defaults x{res.ratios['defaults'][-1]:.4f} (idle {1e6 * idle:.0f} us, "
                        f"probe {1000 * t_probe:.0f} ms)")
        for config in ("every", "defaults"):
            if config in runs:
                add_fixed(res, config, runs[config][1], runs[config][3])
        print(", ".join(line), file=sys.stderr, flush=True)
    if memory:
        run_short = fitter(model, width, depth, 3, args, text)
        for config in ("plain", "every", "defaults"):
            probe = StepMemory(step=2)
            run_short([probe, *extra, *callbacks_for(config, cadence=2)])
            res.memory[config] = float(probe.peak)
    return res


def add_fixed(res: ModelResult, config: str, callbacks: list[Callback], fixed: list[dict]) -> None:
    """Record the fit's fixed costs, ms per monitor: ``fit_start:<config>:<monitor>`` (setup
    and on_fit_start) and ``fit_end:<config>:<monitor>`` (on_train_end), monitor ``ln``
    (LayerNormMonitor) or ``probe`` (the invariance monitor)."""
    for cb, spent in zip(callbacks, fixed, strict=True):
        monitor = "ln" if isinstance(cb, LayerNormMonitor) else "probe"
        for part in ("start", "end"):
            res.add(f"fit_{part}:{config}:{monitor}", 1000 * spent.get(part, 0.0))


def exponents(columns: list[list[float]], ys: list[float]) -> list[float]:
    """Least-squares exponents ``a_i`` of ``y = c * prod x_i^a_i`` (log y against the logs of
    the columns, points with every value positive); nan for a column with a single value,
    and for every column with too few points to fit."""
    points = [(row, y) for *row, y in zip(*columns, ys, strict=True) if min(*row, y) > 0]
    if not points:
        return [math.nan] * len(columns)
    logs = np.log(np.array([row for row, _ in points], dtype=float))
    varying = [j for j in range(len(columns)) if np.ptp(logs[:, j]) > 0]
    out = [math.nan] * len(columns)
    if len(points) > len(varying) and varying:
        design = np.column_stack([logs[:, varying], np.ones(len(points))])
        fitted = np.linalg.lstsq(design, np.log([y for _, y in points]), rcond=None)[0]
        for j, a in zip(varying, fitted, strict=False):
            out[j] = float(a)
    return out


# -- the cost model: a grid of widths x depths, each cell a plain training loop --------------


@dataclass
class Cell:
    """One cell of the cost model (:func:`loop_cell`).  ``plain_ms``: the median unmeasured
    step (ms); ``paired``: the median over measured steps of measured / mean of its two
    unmeasured neighbours; ``probe_ms``: one periodic invariance run (ms); ``loop_s``: the
    loop's wall time (s); ``skipped``: why the cell was not measured (empty when it was)."""

    width: int
    depth: int
    steps: int = 0
    plain_ms: float = math.nan
    paired: float = math.nan
    probe_ms: float = math.nan
    loop_s: float = math.nan
    skipped: str = ""

    @property
    def norms(self) -> int:
        return 2 * self.depth + 1  # ln1 and ln2 of each block, and the final norm

    @property
    def extra_ms(self) -> float:
        """What a measured step adds to a training step, ms."""
        return (self.paired - 1) * self.plain_ms

    def defaults(self, idle_us: float) -> float:
        """Both monitors at their defaults, amortised as the main table's (module docstring),
        with ``idle_us`` the Lightning hooks' time on an unmeasured step."""
        per_step = idle_us / 1000 + self.extra_ms / LN_CADENCE + self.probe_ms / PROBE_CADENCE
        return 1 + per_step / self.plain_ms


def work(width: int, depth: int, context: int) -> float:
    """Multiply-adds per token of a TinyGPT forward (weights, attention, head): a step's time
    grows with it, so a cell's time is estimated from a smaller cell's by this ratio."""
    return depth * (12 * width**2 + 2 * context * width) + VOCAB * width


def cell_bytes(width: int, depth: int, args) -> float:
    """A cell's memory, estimated (bytes): weights, gradients and AdamW's two moments in
    float32 (16 bytes a parameter), 24 float32 activations per token, block and unit of width
    kept for the backward, and 20% to spare."""
    params = 12 * depth * width**2 + (VOCAB + args.context) * width
    return 1.2 * (16 * params + 4 * 24 * args.batch_size * args.context * width * depth)


def first_paired(warmup: int) -> int:
    """The first measured (even) step whose two neighbours are timed."""
    return warmup + 1 if warmup % 2 else warmup + 2



def _update(model, optimizer, recipe) -> None:
    """The recipe's optimizer step, as its fit takes it: clip, step, clear the gradients."""
    if recipe.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

def loop_cell(width: int, depth: int, steps: int, args) -> Cell:
    """Measure one cell without Lightning.  A ``TinyGPT`` (4 heads, the main table's context
    and batch, one fixed batch of random tokens) is stepped in a plain loop as the recipe
    steps it (forward, backward, gradient clipping, AdamW), and on every even step (the
    ``alternate`` configuration) a ``LadderMeter`` measures it: ``start()`` before the
    forward, ``stop()`` after the backward, then ``result().metrics()``: all a measured step
    computes, without what the Lightning callback adds (writing the metrics to TensorBoard,
    a picture every 50 steps).  Each step is timed from its start to the end of its optimizer
    step (synchronised on CUDA).  Then one periodic invariance run is timed: the default
    monitor's cases and scales on its 64 probe windows, without the once-per-fit check."""
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    recipe = Recipe()
    with device:  # built where it trains: a 4096-wide model's initialisation on the host takes minutes
        model = TinyGPT(GPTConfig(vocab_size=VOCAB, width=width, depth=depth, heads=4, context=args.context))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    tokens = torch.randint(VOCAB, (args.batch_size, args.context + 1)).to(device)
    meter = LadderMeter(model, say=lambda text: None, warn=lambda key, text: None)
    times = []
    for step in range(steps):
        measured = step % 2 == 0
        sync()
        t0 = time.perf_counter()
        if measured:
            meter.start()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if measured:
            meter.stop()
            result = meter.result()
            if result is not None:
                result.metrics()
        _update(model, optimizer, recipe)
        sync()
        times.append(time.perf_counter() - t0)
    if meter.off_reason:
        return Cell(width, depth, steps, skipped=f"the meter turned off: {meter.off_reason}")
    monitor = FinalNormInvarianceMonitor()
    probe = torch.randint(VOCAB, (monitor.probe_size, args.context + 1)).to(device)
    prober = InvarianceProbe(model, final_norm="lnf", cases=monitor.cases, scales=monitor.scales)
    prober.checked = True  # the bypass check runs once per fit (a fixed cost), not at every run
    sync()
    t0 = time.perf_counter()
    prober.run((probe[:, :-1], probe[:, 1:]), sweep=False)  # a periodic run: the cases
    sync()
    probe_s = time.perf_counter() - t0
    unmeasured = [t for i, t in enumerate(times) if i >= args.warmup and i % 2]
    return Cell(width, depth, steps, plain_ms=1000 * statistics.median(unmeasured),
                paired=paired(times[args.warmup:], args.warmup), probe_ms=1000 * probe_s,
                loop_s=sum(times))


def plan(width: int, depth: int, done: list[Cell], args) -> tuple[int, str]:
    """Steps for a cell, or 0 and why it is skipped: its memory estimate over
    ``--sweep-memory``, or its time, estimated from the largest cell measured so far, over
    ``--cell-budget`` even at the fewest steps that give two paired ratios."""
    need = cell_bytes(width, depth, args) / 2**30
    if need > args.sweep_memory:
        return 0, f"memory: ~{need:.0f} GiB estimated, over --sweep-memory {args.sweep_memory:.1f} GiB"
    if not done:
        return args.sweep_steps, ""
    ref = done[-1]
    scale = work(width, depth, args.context) / work(ref.width, ref.depth, args.context)
    step_s, probe_s = scale * ref.loop_s / ref.steps, scale * ref.probe_ms / 1000
    steps = min(args.sweep_steps, int((args.cell_budget - probe_s) / step_s))
    fewest = min(args.sweep_steps, first_paired(args.warmup) + 4)
    if steps < fewest:
        return 0, (f"time: ~{fewest * step_s + probe_s:.0f} s at {fewest} steps (from width {ref.width} "
                   f"depth {ref.depth}), over --cell-budget {args.cell_budget:g} s")
    return steps, ""


def run_sweep(args) -> list[Cell]:
    """Every cell of ``--sweep-widths`` x ``--depths``, the least work first (see :func:`plan`)."""
    grid = sorted(((w, d) for w in args.sweep_widths for d in args.depths),
                  key=lambda wd: work(*wd, args.context))
    cells, done = [], []
    for width, depth in grid:
        steps, why = plan(width, depth, done, args)
        if not steps:
            cell = Cell(width, depth, skipped=why)
        else:
            try:
                cell = loop_cell(width, depth, steps, args)
            except torch.OutOfMemoryError as err:
                torch.cuda.empty_cache()
                cell = Cell(width, depth, steps, skipped=f"out of memory ({str(err).splitlines()[0]})")
            if not cell.skipped:
                done.append(cell)
        cells.append(cell)
        said = (f"skipped, {cell.skipped}" if cell.skipped else
                f"{steps} steps, plain {cell.plain_ms:.1f} ms, extra {cell.extra_ms:.2f} ms "
                f"(x{cell.paired:.4f}), invariance run {cell.probe_ms:.0f} ms, loop {cell.loop_s:.0f} s")
        print(f"sweep width {width} depth {depth}: {said}", file=sys.stderr, flush=True)
    return sorted(cells, key=lambda c: (c.depth, c.width))


def cost_figure(cells: list[Cell], path: Path, args) -> None:
    """PNG: a measured step's extra time as a fraction of a training step against width, one
    line per depth, log axes, with the 1% line (cells skipped or below zero are not drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for depth in sorted({c.depth for c in cells}):
        points = [(c.width, c.paired - 1) for c in cells if c.depth == depth and c.paired > 1]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=f"depth {depth} ({2 * depth + 1} norms)")
    ax.axhline(0.01, color="grey", linestyle="--", linewidth=1, label="1% of a step")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    widths = sorted({c.width for c in cells})
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("width")
    ax.set_ylabel("measured step's extra time / training step")
    ax.set_title(f"LayerNormMonitor, one measured step ({args.device}, batch {args.batch_size} x "
                 f"context {args.context})", fontsize=10)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def sweep_table(cells: list[Cell], idle_us: float, args) -> list[str]:
    """The cost model's markdown: one row per cell, the fitted exponents, where it falls under 1%."""
    rows = args.batch_size * args.context
    said_idle = (f"with the Lightning hooks' {idle_us:.0f} us per unmeasured step from the main table"
                 if idle_us else "without the Lightning hooks' idle time (no main table in this run)")
    out = ["", f"Cost model: a measured step against width and depth ({rows} rows a step, {args.warmup} "
           "warm-up steps; a plain loop with the LadderMeter on alternate steps, see `loop_cell`; "
           f"defaults amortised {said_idle}):", "",
           "| width | depth | norms | rows x width | steps | plain ms/step | measured-step extra ms "
           "| extra / step | defaults (amortised) | invariance run ms |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        head = f"| {c.width} | {c.depth} | {c.norms} | {rows * c.width:,} "
        if c.skipped:
            out.append(head + f"| - | skipped: {c.skipped} | | | | |")
            continue
        out.append(head + f"| {c.steps} | {c.plain_ms:.1f} | {c.extra_ms:.2f} | {c.paired - 1:.4f} "
                          f"| {c.defaults(idle_us):.4f}x | {c.probe_ms:.0f} |")
    ran = [c for c in cells if not c.skipped]
    size, norms = [rows * c.width for c in ran], [c.norms for c in ran]
    extra = exponents([size, norms], [c.extra_ms for c in ran])
    step = exponents([size, norms], [c.plain_ms for c in ran])
    def a(x: float) -> str:
        return f"{x:.2f}" if math.isfinite(x) else "?"

    out += ["", f"Fitted exponents (least squares over the {len(ran)} cells measured, cells with a negative "
            f"extra left out): the extra time grows as (rows x width)^{a(extra[0])} x norms^{a(extra[1])}, "
            f"the training step as (rows x width)^{a(step[0])} x norms^{a(step[1])} (?: not varied "
            "over the cells, or too few cells)."]
    for depth in sorted({c.depth for c in ran}):
        line = [c for c in ran if c.depth == depth]
        under = [c.width for i, c in enumerate(line) if all(d.paired - 1 < 0.01 for d in line[i:])]
        out.append(f"- depth {depth}: the every-step cost is under 1% of a step from width "
                   f"{under[0]} on (measured up to {line[-1].width})." if under else
                   f"- depth {depth}: the every-step cost stays at or above 1% up to width {line[-1].width}.")
    return out


def fixed_cells(r: ModelResult) -> str:
    """The main table's fixed costs per fit (ms, medians over rounds): fit start and fit end at
    the defaults, each as LayerNormMonitor + invariance monitor; fit end of the every-step
    fit; and both ends at the defaults in plain steps."""
    def ms(part: str, config: str, monitor: str) -> float:
        return r.median(f"fit_{part}:{config}:{monitor}")

    start, end = (ms(part, "defaults", "ln") + ms(part, "defaults", "probe") for part in ("start", "end"))
    return (f"{ms('start', 'defaults', 'ln'):.0f} + {ms('start', 'defaults', 'probe'):.0f} "
            f"| {ms('end', 'defaults', 'ln'):.0f} + {ms('end', 'defaults', 'probe'):.0f} "
            f"| {ms('end', 'every', 'ln'):.0f} | {(start + end) / statistics.median(r.plain_ms):.1f}")


def tables(main: list[ModelResult], compiled: list[ModelResult], sweep: list[Cell],
           peers: ModelResult | None, args) -> str:
    """The markdown of every row measured."""
    out = [f"{args.device}, batch {args.batch_size} x context {args.context}, torch threads "
           f"{torch.get_num_threads()}, torch {torch.__version__}."]
    if main or compiled or peers:
        out += ["", f"Fits of {args.steps} steps ({args.warmup} warm-up), {args.rounds} interleaved rounds; "
                "ratios are medians over rounds.", ""]
    if main:
        out += ["| model | width | plain ms/step | every step, paired | every step, direct "
                "| defaults (amortised) | of which the invariance probe | defaults, unmeasured step, direct "
                "| idle hooks us/step | measured-step extra ms | invariance run ms "
                "| fit start ms, defaults (LN + probe) | fit end ms, defaults (LN + probe) "
                "| fit end ms, every step | fixed per fit, defaults, in plain steps "
                "| peak: every step | peak: defaults, both firing |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in main:
        mem = r.memory
        peak = (f"{mem['every'] / mem['plain']:.3f}x | {mem['defaults'] / mem['plain']:.3f}x"
                if mem else "- | -")
        name = "GPT-2 example" if r.model == "gpt2" else "train-tiny"
        out.append(f"| {name} | {r.width} | {statistics.median(r.plain_ms):.1f} | {r.median('paired'):.3f}x "
                   f"| {r.median('every'):.3f}x | {r.median('defaults'):.4f}x "
                   f"| +{r.median('probe_part'):.4f} | {r.median('unmeasured'):.3f}x "
                   f"| {r.median('idle_us'):.0f} | {r.median('measured_extra_ms'):.1f} "
                   f"| {r.median('probe_ms'):.0f} | {fixed_cells(r)} | {peak} |")
    if main:
        out += ["", "Fixed costs per fit, paid once whatever its length: fit start = the monitors' `setup` "
                "and `on_fit_start` (discovery, the float64 self-check, hparams; LN = LayerNormMonitor, "
                "probe = the invariance monitor; for the probe also its first run's one-time checks: the "
                "final norm, the probe's loss, the gradient pass that checks the norm is final), fit end = "
                "their `on_train_end` (the last invariance run, the heatmap picture, the summaries). A fit "
                "of N steps at the defaults costs about defaults (amortised) + (fixed per fit, in plain "
                "steps) / N times the unmonitored fit."]
    if compiled:
        out += ["", "Compiled (`module.model.compile()`), against the same compiled model unmonitored:", "",
                "| width | compiled plain ms/step | every step, paired | defaults (amortised) "
                "| defaults, unmeasured step, direct | measured-step extra ms |",
                "|---:|---:|---:|---:|---:|---:|"]
        for r in compiled:
            out.append(f"| {r.width} | {statistics.median(r.plain_ms):.1f} | {r.median('paired'):.3f}x "
                       f"| {r.median('defaults'):.4f}x | {r.median('unmeasured'):.3f}x "
                       f"| {r.median('measured_extra_ms'):.1f} |")
    if sweep:
        idle = [r.median("idle_us") for r in main if r.model == "tiny"]
        out += sweep_table(sweep, statistics.median(idle) if idle else 0.0, args)
    if peers is not None:
        out += ["", f"Peers, every step, width {peers.width}, direct ratios against the model unmonitored:",
                "", "| monitor | every step |", "|---|---:|",
                f"| lnmonitor LayerNormMonitor(every_n_steps=1) | {peers.median('every'):.3f}x |",
                f"| Lightning grad_norm, logged every step | {peers.median('grad_norm'):.3f}x |"]
        if "wandb_watch" in peers.ratios:
            watch = peers.median("wandb_watch")
            out.append(f"| wandb.watch(log='all', log_freq=1), offline | {watch:.3f}x |")
    return "\n".join(out) + "\n"


# -- the small rows (--small) ------------------------------------------------------------------

# (label, width, depth, batch, context)
SMALL_SHAPES = (
    ("nanoGPT's smallest (TinyGPT 2 x 64, batch 12)", 64, 2, 12, 64),
    ("tiny, width 64 (4 x 64)", 64, 4, None, None),
    ("tiny, width 128 (4 x 128)", 128, 4, None, None),
)


@dataclass
class SmallRow:
    label: str
    width: int
    depth: int
    batch: int
    context: int
    steps: int
    plain_ms: float = math.nan
    every_ms: float = math.nan
    defaults_idle_ms: float = math.nan
    quiet_idle_ms: float = math.nan
    plain_peak_mb: float = math.nan
    every_peak_mb: float = math.nan

    @property
    def every(self) -> float:
        return self.every_ms / self.plain_ms

    @property
    def defaults(self) -> float:
        return (self.defaults_idle_ms + (self.every_ms - self.plain_ms) / LN_CADENCE) / self.plain_ms

    @property
    def quiet(self) -> float:
        """The defaults with ``findings=False``: no every-step growth watch."""
        return (self.quiet_idle_ms + (self.every_ms - self.plain_ms) / LN_CADENCE) / self.plain_ms


def import_seconds(runs: int = 3) -> float:
    """Median wall time of importing the loop door after torch, each in a fresh interpreter."""
    code = ("import time, torch; t = time.perf_counter(); import lnmonitor.integrations.loop; "
            "print(time.perf_counter() - t)")
    times = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True).stdout) for _ in range(runs)]
    return statistics.median(times)


def peak_bytes(step: Callable[[], None]) -> int:
    """Peak bytes allocated during ``step()`` and not freed before (CPU: the profiler's timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    live = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def small_row(label: str, width: int, depth: int, batch: int, context: int, args) -> SmallRow:
    """One row of the small table (see the module docstring): three loops stepped side by side."""
    torch.manual_seed(0)
    recipe = Recipe()
    base = TinyGPT(GPTConfig(vocab_size=VOCAB, width=width, depth=depth, heads=4, context=context))
    batches = torch.randint(VOCAB, (max(args.steps, 3), batch, context + 1))

    def build(config: str, steps: int | None) -> tuple:
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        monitor = None
        if config == "every":
            monitor = LoopMonitor(model, every_n_steps=1, max_steps=steps, invariance_every_n_steps=None,
                                  images=False, summary=False, keep_history=False)
        elif config == "defaults":
            monitor = LoopMonitor(model, max_steps=steps)
        elif config == "quiet":
            monitor = LoopMonitor(model, max_steps=steps, findings=False)
        return model, optimizer, monitor

    loops = {config: build(config, args.steps) for config in ("plain", "every", "defaults", "quiet")}

    def step(config: str, i: int) -> None:
        model, optimizer, monitor = loops[config]
        if monitor is not None:
            monitor.start(i)
        _, loss = model(batches[i, :, :-1], batches[i, :, 1:])
        loss.backward()
        if monitor is not None:
            monitor.stop()
        _update(model, optimizer, recipe)

    order = list(loops)
    times: dict[str, list[tuple[int, float]]] = {c: [] for c in order}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the doors' notes (no writer, no probe batch)
        for i in range(args.steps):
            rotated = order[i % len(order):] + order[:i % len(order)]
            for config in rotated:
                t0 = time.perf_counter()
                step(config, i)
                times[config].append((i, time.perf_counter() - t0))
    for _, _, monitor in loops.values():
        if monitor is not None:
            monitor.close()

    def median_ms(config: str, keep: Callable[[int], bool]) -> float:
        kept = [t for i, t in times[config] if i >= args.warmup and keep(i)]
        return 1000 * statistics.median(kept) if kept else math.nan

    row = SmallRow(label, width, depth, batch, context, args.steps,
                   plain_ms=median_ms("plain", lambda i: True), every_ms=median_ms("every", lambda i: True),
                   defaults_idle_ms=median_ms("defaults", lambda i: i % LN_CADENCE and i != args.steps - 1),
                   quiet_idle_ms=median_ms("quiet", lambda i: i % LN_CADENCE and i != args.steps - 1))
    if args.memory:  # fresh loops, two steps each before the one recorded
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for config in ("plain", "every"):
                loops[config] = build(config, None)
                step(config, 0)
                step(config, 1)
            row.plain_peak_mb = peak_bytes(lambda: step("plain", 2)) / 2**20
            row.every_peak_mb = peak_bytes(lambda: step("every", 2)) / 2**20
    return row


def small_table(rows: list[SmallRow], import_s: float, args) -> list[str]:
    out = [
        f"### Small models, plain loop (LoopMonitor), {args.steps} steps, {args.warmup} untimed, "
        f"{torch.get_num_threads()} threads",
        "",
        "| shape | plain step | measured step | every step | defaults (amortised) | defaults, findings off "
        "| import (loop door) | peak, plain / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| {r.label} | {r.plain_ms:.1f} ms | {r.every_ms:.1f} ms | {r.every:.2f}x | "
                   f"{r.defaults:.3f}x | {r.quiet:.3f}x | {import_s:.2f} s "
                   f"| {r.plain_peak_mb:.1f} / {r.every_peak_mb:.1f} MB |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="*", default=[128, 512, 1024],
                        help="the main table's widths, depth 4 (none: no main table)")
    parser.add_argument("--sweep", action="store_true",
                        help="also the cost model: --sweep-widths x --depths in a plain loop (loop_cell)")
    parser.add_argument("--sweep-widths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 12, 24], help="the cost model's depths")
    parser.add_argument("--sweep-steps", type=int, default=16,
                        help="steps per cost-model cell, fewer where --cell-budget demands (default: 16)")
    parser.add_argument("--cell-budget", type=float, default=900,
                        help="seconds a cost-model cell may take, estimated (default: 900)")
    parser.add_argument("--sweep-memory", type=float, default=None,
                        help="GiB a cost-model cell may use, estimated (default: half the memory on CPU, "
                             "which is shared; 80%% of the GPU's)")
    parser.add_argument("--figure", type=Path, default=None,
                        help="the cost model's PNG (default: benchmarks/results/cost_model_<device>.png)")
    parser.add_argument("--small", action="store_true",
                        help="also the small rows: nanoGPT's smallest shape, the tiny model at widths "
                             "64 and 128")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the small rows' peak memory (the profiler takes seconds)")
    parser.add_argument("--import-runs", type=int, default=3,
                        help="fresh interpreters timing the loop door's import (default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="also the compiled model, at width 128")
    parser.add_argument("--peers", action="store_true", help="also grad_norm and wandb.watch, width 128")
    parser.add_argument("--gpt2", action="store_true",
                        help="also the GPT-2 of examples/transformers_causal_lm.py (transformers, width 128)")
    parser.add_argument("--steps", type=int, default=12, help="steps per fit (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: 32)")
    parser.add_argument("--context", type=int, default=64, help="sequence length (default: 64)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--json", default=None, help="also write every per-round figure to this file")
    args = parser.parse_args(argv)
    if (args.widths or args.gpt2 or args.compile or args.peers) and args.steps < args.warmup + 5:
        parser.error("--steps must be at least --warmup + 5 (the paired estimate needs them)")
    if args.sweep and args.sweep_steps < first_paired(args.warmup) + 2:
        parser.error(f"--sweep-steps must be at least {first_paired(args.warmup) + 2} at --warmup "
                     f"{args.warmup} (one measured step with both neighbours timed)")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (step 0 is where the default monitors run)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep_memory is None:
        args.sweep_memory = (0.8 * torch.cuda.get_device_properties(0).total_memory if args.device == "cuda"
                             else 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
    text = load_corpus() if args.widths or args.gpt2 or args.compile or args.peers else ""
    full = ("plain", "every", "alternate", "defaults")
    main_rows = [bench(w, 4, full, args, text, memory=True) for w in args.widths]
    if args.gpt2:
        main_rows.append(bench(128, 4, full, args, text, memory=True, model="gpt2"))
    compiled = []
    if args.compile:
        compiled = [bench(128, 4, ("plain", "alternate", "defaults"), args, text, compiled=True)]
    sweep = run_sweep(args) if args.sweep else []
    peers = None
    if args.peers:
        configs = ("plain", "every", "grad_norm")
        try:
            import wandb  # noqa: F401

            configs += ("wandb_watch",)
        except ImportError:
            print("overhead: wandb is not installed (pip install -e '.[bench]'): no wandb.watch row",
                  file=sys.stderr)
        peers = bench(128, 4, configs, args, text)
    text_out = tables(main_rows, compiled, sweep, peers, args)
    small = []
    if args.small:
        small = [small_row(label, w, d, batch or args.batch_size, context or args.context, args)
                 for label, w, d, batch, context in SMALL_SHAPES]
        text_out += "\n\n" + "\n".join(small_table(small, import_seconds(args.import_runs), args)) + "\n"
    print("\n" + text_out)
    if sweep:
        figure = args.figure or RESULTS / f"cost_model_{args.device}.png"
        cost_figure(sweep, figure, args)
        print(f"overhead: the cost model's figure is {figure}", file=sys.stderr)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text_out)
    if args.json:
        with open(args.json, "w") as handle:
            settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            json.dump({"args": settings, "main": [asdict(r) for r in main_rows],
                       "compiled": [asdict(r) for r in compiled], "sweep": [asdict(r) for r in sweep],
                       "peers": asdict(peers) if peers else None, "small": [asdict(r) for r in small]},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
