"""What the monitors cost a Lightning fit: step time, peak memory and fixed costs per fit.

Every figure is a ratio between fits of the same recipe (``lnmonitor.tiny.train.fit``,
TensorBoard logger, no progress bar, the same batches) run in one process, interleaved
round by round in rotated order (``stepping.in_turns``).  A callback stamps each batch start
(after ``torch.cuda.synchronize()`` on a GPU); a step's time is the gap to the next stamp
(forward, backward, optimizer, every callback and logging).  Reported: medians over rounds of
per-round ratios.

Configurations of one model:

* ``plain``: no monitor;  ``every``: ``LayerNormMonitor(every_n_steps=1)``;
* ``alternate``: ``LayerNormMonitor(every_n_steps=2)``: its *paired* ratio is the median
  over measured steps of the measured step / the mean of its two unmeasured neighbours
  (``stepping.paired``), far less exposed to other load than separate fits;
* ``defaults``: both monitors at their defaults (the recipe logs every 50 steps; the
  invariance probe runs every 1000 steps).  A short fit cannot hold 50 or 1000 steps of
  every width, so the defaults' cost is amortised from parts measured directly:
  ``1 + (t_idle + (paired - 1) t_plain / 50 + t_probe / 1000) / t_plain`` with
  ``t_idle`` the time inside the two monitors' Lightning hooks on a step where neither
  measures and ``t_probe`` the wall time of one periodic invariance run (not the first,
  whose one-time checks are a fixed cost per fit).

Rows: the main table (``--widths``, depth 4; ``--gpt2`` adds the GPT-2 of
examples/transformers_causal_lm.py, a transformers model without a ``forward``, fitted as
that example fits it); ``--compile``: the same model with its inner ``nn.Module`` compiled
in place (``module.model.compile()``), against the compiled model unmonitored (the measured
steps run eagerly, see LayerNormMonitor); ``--peers``: Lightning's ``grad_norm`` utility
logged every step and ``wandb.watch(log="all", log_freq=1)`` offline, every step, next
to ``LayerNormMonitor(every_n_steps=1)`` (``pip install -e ".[bench]"``).

Fixed costs per fit (main table): the wall time inside the monitors' ``setup`` and
``on_fit_start`` (fit start: discovery, the float64 self-check, hparams; for the
invariance monitor also its first run's one-time checks, see :class:`TimedProbe`) and
``on_train_end`` (fit end: the last invariance run, the heatmap picture, the summaries),
ms per monitor, from the ``every`` and ``defaults`` fits above.

Memory: one measured step of ``plain``, ``every`` and ``defaults`` (both monitors firing),
its peak allocation (``stepping.PeakMemory``: the ``torch.profiler`` allocation timeline on
the CPU, ``torch.cuda.max_memory_allocated`` on CUDA).

    python benchmarks/overhead.py --widths 128 512 1024 --steps 12 --rounds 3 --threads 2 \\
        --gpt2 --compile --peers --markdown overhead.md
    python benchmarks/overhead.py --widths 32 --steps 7 --rounds 1 --batch-size 2 --context 8  # smoke run
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
from typing import NamedTuple

import lightning as L
import stepping
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor.lightning import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)
FIT_START = ("setup", "on_fit_start")  # discovery, the float64 self-check, hparams
FIT_END = ("on_train_end",)  # the last invariance run, the heatmap picture, the summary


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
    """The peak bytes allocated during training step ``step`` (``peak``; see the module docstring)."""

    def __init__(self, step: int) -> None:
        self.step, self.peak, self._memory = step, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self._memory is None:
            self._memory = stepping.PeakMemory(pl_module.device.type == "cuda").__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._memory is not None and self.peak is None:
            self._memory.__exit__(None, None, None)
            self.peak = self._memory.peak


def time_hooks(callback: Callback, seconds: dict, hooks: tuple[str, ...] = HOOKS, key: str | None = None,
               ) -> None:
    """Wrap the callback's ``hooks``; ``seconds[key]`` accumulates the seconds spent inside them
    (``key`` None: the trainer's global step, one entry per step)."""
    for name in hooks:
        method = getattr(callback, name)

        def timed(trainer, *args, _method=method, **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(trainer, *args, **kwargs)
            finally:
                where = trainer.global_step if key is None else key
                seconds[where] = seconds.get(where, 0.0) + time.perf_counter() - t0

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
        return [LayerNormMonitor(every_n_steps=cadence), TimedProbe(invariance_every_n_steps=cadence)]
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
            callbacks=callbacks, accelerator=args.device, devices=1, log_every_n_steps=stepping.LN_CADENCE,
            val_check_interval=steps + 1, check_val_every_n_epoch=None, limit_val_batches=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(module, train, val)


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


class Fit(NamedTuple):
    """One fit of a configuration: its steps' seconds after the warm-up, its callbacks, the seconds
    inside the monitors' per-step hooks by step (``defaults`` only), and each callback's fixed
    seconds (``start``, ``end``)."""

    steps: list[float]
    callbacks: list[Callback]
    inside: dict[int, float]
    fixed: list[dict[str, float]]


def bench(width: int, depth: int, configs: tuple[str, ...], args, text: str, compiled: bool = False,
          memory: bool = False, model: str = "tiny") -> ModelResult:
    """``args.rounds`` interleaved rounds of fits of one model, one fit per configuration a round."""
    run_fit = fitter(model, width, depth, args.steps, args, text)
    extra = [CompileInner()] if compiled else []
    name = f"{'compiled ' if compiled else ''}{model} width {width} depth {depth}"

    def one_fit(config: str, rnd: int) -> Fit:
        timer, callbacks, inside = stepping.StepTimer(args.device == "cuda"), callbacks_for(config), {}
        fixed = [{} for _ in callbacks]
        for cb, spent in zip(callbacks, fixed, strict=True):
            if config == "defaults":
                time_hooks(cb, inside)
            time_hooks(cb, spent, FIT_START, "start")
            time_hooks(cb, spent, FIT_END, "end")
        run_fit([*extra, *callbacks, timer])
        for cb, spent in zip(callbacks, fixed, strict=True):
            spent["start"] = spent.get("start", 0.0) + getattr(cb, "setup_seconds", 0.0)
        steps = timer.gaps(args.warmup)
        print(f"{name} round {rnd + 1}, {config}: {1000 * statistics.median(steps):.1f} ms a step",
              file=sys.stderr, flush=True)
        return Fit(steps, callbacks, inside, fixed)

    fits = stepping.in_turns(one_fit, configs, args.rounds)
    res = ModelResult(width, depth, compiled, model)
    for rnd in range(args.rounds):
        add_round(res, {config: fits[config][rnd] for config in configs}, args)
    if memory:
        run_short = fitter(model, width, depth, 3, args, text)
        for config in ("plain", "every", "defaults"):
            probe = StepMemory(step=2)
            run_short([probe, *extra, *callbacks_for(config, cadence=2)])
            res.memory[config] = float(probe.peak)
    return res


def add_round(res: ModelResult, fits: dict[str, Fit], args) -> None:
    """One round's figures: each configuration's direct ratio to ``plain``, ``alternate``'s paired
    ratio, the defaults' parts and amortised ratio, and the fixed costs per fit."""
    plain = statistics.median(fits["plain"].steps)
    res.plain_ms.append(1000 * plain)
    for config, one in fits.items():
        if config not in ("plain", "alternate", "defaults"):
            res.add(config, statistics.median(one.steps) / plain)
    if "alternate" in fits:
        res.add("paired", stepping.paired(fits["alternate"].steps, args.warmup))
        res.add("measured_extra_ms", 1000 * (res.ratios["paired"][-1] - 1) * plain)
    if "defaults" in fits:
        steps, callbacks, inside, _ = fits["defaults"]
        probe = callbacks[1].run_seconds
        t_probe = probe[-1] if probe else 0.0
        # steps whose hooks all lie in the run, excluding step 0 where both monitors run
        idle = statistics.median(inside[s] for s in range(args.warmup + 1, args.steps - 1))
        measured = res.ratios["paired"][-1] - 1 if "paired" in res.ratios else 0.0
        res.add("unmeasured", statistics.median(steps) / plain)
        res.add("idle_us", 1e6 * idle)
        res.add("probe_ms", 1000 * t_probe)
        res.add("defaults", stepping.amortised(plain, idle, measured * plain, t_probe))
        res.add("probe_part", stepping.amortised(plain, probe=t_probe) - 1)
    for config in ("every", "defaults"):
        if config in fits:
            add_fixed(res, config, fits[config].callbacks, fits[config].fixed)


def add_fixed(res: ModelResult, config: str, callbacks: list[Callback], fixed: list[dict]) -> None:
    """Record the fit's fixed costs, ms per monitor: ``fit_start:<config>:<monitor>`` (setup
    and on_fit_start) and ``fit_end:<config>:<monitor>`` (on_train_end), monitor ``ln``
    (LayerNormMonitor) or ``probe`` (the invariance monitor)."""
    for cb, spent in zip(callbacks, fixed, strict=True):
        monitor = "ln" if isinstance(cb, LayerNormMonitor) else "probe"
        for part in ("start", "end"):
            res.add(f"fit_{part}:{config}:{monitor}", 1000 * spent.get(part, 0.0))


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


def tables(main: list[ModelResult], compiled: list[ModelResult], peers: ModelResult | None, args) -> str:
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
    parser.add_argument("--widths", type=int, nargs="*", default=[128, 512, 1024],
                        help="the main table's widths, depth 4 (none: no main table)")
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
    stepping.set_threads(args.threads)
    text = load_corpus()
    full = ("plain", "every", "alternate", "defaults")
    main_rows = [bench(w, 4, full, args, text, memory=True) for w in args.widths]
    if args.gpt2:
        main_rows.append(bench(128, 4, full, args, text, memory=True, model="gpt2"))
    compiled = []
    if args.compile:
        compiled = [bench(128, 4, ("plain", "alternate", "defaults"), args, text, compiled=True)]
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
    text_out = tables(main_rows, compiled, peers, args)
    print("\n" + text_out)
    if args.markdown:
        Path(args.markdown).write_text(text_out)
    if args.json:
        figures = {"args": vars(args), "main": [asdict(r) for r in main_rows],
                   "compiled": [asdict(r) for r in compiled], "peers": asdict(peers) if peers else None}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
