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
  measures and ``t_probe`` the wall time of one invariance run.

Rows: the main table (``--widths``, depth 4; ``--gpt2`` adds the GPT-2 of
examples/transformers_causal_lm.py, a transformers model without a ``forward``, fitted as
that example fits it);
``--compile``: the same model with its inner ``nn.Module`` compiled in place
(``module.model.compile()``), against the compiled model unmonitored (the measured steps
run eagerly, see LayerNormMonitor); ``--depths``: the extra time of a measured step at
width 128 and these depths, and the exponents of its growth with width and depth
(against rows x width x norms read); ``--peers``: Lightning's ``grad_norm`` utility
logged every step and ``wandb.watch(log="all", log_freq=1)`` offline, every step, next
to ``LayerNormMonitor(every_n_steps=1)`` (``pip install -e ".[bench]"``).

Memory: one measured step of ``plain``, ``every`` and ``defaults`` (both monitors firing)
is recorded with ``torch.profiler`` (``profile_memory=True``) and its allocation timeline
replayed: the peak is the maximum over the step of the bytes allocated since it began and
not yet freed.  On CUDA, ``torch.cuda.max_memory_allocated`` over the step.

    python benchmarks/overhead.py --widths 128 512 1024 --steps 12 --rounds 3 --threads 2 \\
        --gpt2 --compile --depths 4 8 16 --peers --markdown overhead.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
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

from lnmonitor.lightning import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit

LN_CADENCE = 50  # the recipe's and the GPT-2 example's log_every_n_steps
PROBE_CADENCE = FinalNormInvarianceMonitor().every_n_steps  # its default: every 1000 steps
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)


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
    """The default invariance monitor, with the wall time of each run recorded."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.run_seconds: list[float] = []

    def _run(self, trainer, pl_module, step) -> None:
        before = self.last_result
        t0 = time.perf_counter()
        super()._run(trainer, pl_module, step)
        if self.last_result is not before:
            self.run_seconds.append(time.perf_counter() - t0)


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


def time_hooks(callback: Callback, sink: dict[int, float]) -> None:
    """Wrap the callback's per-step hooks; ``sink[step]`` accumulates seconds inside them."""
    for name in HOOKS:
        method = getattr(callback, name)

        def timed(trainer, *args, _method=method, **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(trainer, *args, **kwargs)
            finally:
                step = trainer.global_step
                sink[step] = sink.get(step, 0.0) + time.perf_counter() - t0

        setattr(callback, name, timed)


def callbacks_for(config: str, cadence: int | None = None) -> list[Callback]:
    """The callbacks of a configuration (``cadence`` forces both default monitors to fire)."""
    if config == "every":
        return [LayerNormMonitor(every_n_steps=1, summary=False)]
    if config == "alternate":
        return [LayerNormMonitor(every_n_steps=2, summary=False)]
    if config == "defaults":
        if cadence is None:
            return [LayerNormMonitor(summary=False), TimedProbe(summary=False)]
        return [LayerNormMonitor(every_n_steps=cadence, summary=False),
                TimedProbe(every_n_steps=cadence, summary=False)]
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
            if config == "defaults":
                for cb in cbs:
                    time_hooks(cb, inside)
            run_fit([*extra, *cbs, timer])
            runs[config] = (gaps(timer.starts, args.warmup), cbs, inside)
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
            steps, cbs, inside = runs["defaults"]
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
        print(", ".join(line), file=sys.stderr, flush=True)
    if memory:
        run_short = fitter(model, width, depth, 3, args, text)
        for config in ("plain", "every", "defaults"):
            probe = StepMemory(step=2)
            run_short([probe, *extra, *callbacks_for(config, cadence=2)])
            res.memory[config] = float(probe.peak)
    return res


def exponent(xs: list[float], ys: list[float]) -> float:
    """The slope of log y against log x (least squares); nan with fewer than two points."""
    ok = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(ok) < 2:
        return math.nan
    lx, ly = np.array(ok).T
    return float(np.polyfit(lx, ly, 1)[0])


def tables(main: list[ModelResult], compiled: list[ModelResult], sweep: list[ModelResult],
           peers: ModelResult | None, args) -> str:
    """The markdown of every row measured."""
    out = [f"{args.device}, batch {args.batch_size} x context {args.context}, {args.steps} steps per fit "
           f"({args.warmup} warm-up), {args.rounds} interleaved rounds, torch threads "
           f"{torch.get_num_threads()}, torch {torch.__version__}; ratios are medians over rounds.", ""]
    header = ["| model | width | plain ms/step | every step, paired | every step, direct "
              "| defaults (amortised) | of which the invariance probe | defaults, unmeasured step, direct "
              "| idle hooks us/step "
              "| measured-step extra ms | invariance run ms | peak: every step "
              "| peak: defaults, both firing |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out += header
    for r in main:
        mem = r.memory
        peak = (f"{mem['every'] / mem['plain']:.3f}x | {mem['defaults'] / mem['plain']:.3f}x"
                if mem else "- | -")
        name = "GPT-2 example" if r.model == "gpt2" else "train-tiny"
        out.append(f"| {name} | {r.width} | {statistics.median(r.plain_ms):.1f} | {r.median('paired'):.3f}x "
                   f"| {r.median('every'):.3f}x | {r.median('defaults'):.4f}x "
                   f"| +{r.median('probe_part'):.4f} | {r.median('unmeasured'):.3f}x "
                   f"| {r.median('idle_us'):.0f} | {r.median('measured_extra_ms'):.1f} "
                   f"| {r.median('probe_ms'):.0f} | {peak} |")
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
        by_width = [r for r in main if r.depth == 4 and r.model == "tiny"]
        by_depth = sorted([*sweep, *(r for r in by_width if r.width == 128)], key=lambda r: r.depth)
        out += ["", "Extra time of one measured step (paired) against what it reads:", "",
                "| width | depth | norms | rows x width x norms | plain ms | measured-step extra ms |",
                "|---:|---:|---:|---:|---:|---:|"]
        rows = args.batch_size * args.context
        for r in sorted({(r.width, r.depth): r for r in by_width + by_depth}.values(),
                        key=lambda r: (r.depth, r.width)):
            read = rows * r.width * (2 * r.depth + 1)
            out.append(f"| {r.width} | {r.depth} | {2 * r.depth + 1} | {read:,} "
                       f"| {statistics.median(r.plain_ms):.1f} | {r.median('measured_extra_ms'):.2f} |")
        ew = exponent([r.width for r in by_width], [r.median("measured_extra_ms") for r in by_width])
        ed = exponent([2 * r.depth + 1 for r in by_depth], [r.median("measured_extra_ms") for r in by_depth])
        out += ["", f"Fitted exponents of the extra time: width^{ew:.2f} (widths "
                f"{', '.join(str(r.width) for r in by_width)}, depth 4), norms^{ed:.2f} (depths "
                f"{', '.join(str(r.depth) for r in by_depth)}, width 128); the data read grows as "
                "width^1 and norms^1."]
    if peers is not None:
        out += ["", f"Peers, every step, width {peers.width}, direct ratios against the model unmonitored:",
                "", "| monitor | every step |", "|---|---:|",
                f"| lnmonitor LayerNormMonitor(every_n_steps=1) | {peers.median('every'):.3f}x |",
                f"| Lightning grad_norm, logged every step | {peers.median('grad_norm'):.3f}x |"]
        if "wandb_watch" in peers.ratios:
            watch = peers.median("wandb_watch")
            out.append(f"| wandb.watch(log='all', log_freq=1), offline | {watch:.3f}x |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--depths", type=int, nargs="*", default=[],
                        help="also time a measured step at width 128 and these depths (the cost curve)")
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
    if args.steps < args.warmup + 5:
        parser.error("--steps must be at least --warmup + 5 (the paired estimate needs them)")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (step 0 is where the default monitors run)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    text = load_corpus()
    full = ("plain", "every", "alternate", "defaults")
    main_rows = [bench(w, 4, full, args, text, memory=True) for w in args.widths]
    if args.gpt2:
        main_rows.append(bench(128, 4, full, args, text, memory=True, model="gpt2"))
    compiled = []
    if args.compile:
        compiled = [bench(128, 4, ("plain", "alternate", "defaults"), args, text, compiled=True)]
    sweep = [bench(128, d, ("plain", "alternate"), args, text) for d in args.depths if d != 4]
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
    print("\n" + text_out)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(text_out)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "main": [asdict(r) for r in main_rows],
                       "compiled": [asdict(r) for r in compiled], "sweep": [asdict(r) for r in sweep],
                       "peers": asdict(peers) if peers else None}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
