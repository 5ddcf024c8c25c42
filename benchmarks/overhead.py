"""Cost of the monitors on the train-tiny recipe: step time and peak memory.

Three configurations train the recipe (``lnmonitor.tiny.train.fit``, TensorBoard
logger, no progress bar) on the same batches:

* ``plain``: no monitor;
* ``every``: ``LayerNormMonitor(every_n_steps=1)``: every step is measured;
* ``defaults``: ``LayerNormMonitor()`` and ``FinalNormInvarianceMonitor()`` at their
  defaults (the recipe's ``log_every_n_steps`` = 50; the invariance probe every 1000
  steps and after each validation, i.e. every ``val_every`` = 250 steps).

Time.  Each round runs four fits, in rotated order (interleaved, so load from other
processes hits all alike): the three configurations and ``alternate``
(``LayerNormMonitor(every_n_steps=2)``).  A callback stamps each batch start; a step's
time is the gap to the next stamp (forward, backward, optimizer, every callback and
logging).  Per round:

* ``every step, direct``: median step of ``every`` / median step of ``plain``;
* ``every step, paired``: in ``alternate``, the median over measured steps of the
  measured step / the mean of its two unmeasured neighbours -- the same ratio from
  steps a few hundred ms apart, so it is far less exposed to other processes' load;
* ``defaults, unmeasured``: median step of ``defaults`` (no hook registered) / plain:
  across two fits, so it shows the fit-to-fit noise of this machine as much as anything;
* ``idle us``: the time actually spent inside the two monitors' Lightning hooks on a
  step where neither measures (every hook method wrapped with a timer);
* ``defaults, amortised``: ``1 + (t_idle + (paired - 1) t_plain / 50 + t_probe / 250)
  / t_plain``, with ``t_probe`` the wall time of one invariance run (timed inside the
  callback, its steady-state run): a short benchmark cannot hold 50 or 250 steps of
  every width, so each part is measured directly and amortised at the recipe's cadence.

Reported: medians over rounds of these per-round ratios.

Memory.  CPU tensors do not go through a caching allocator with statistics, and
process-level figures (``resource``'s max RSS, psutil) are too coarse and never go
down.  So one measured step (step 2) of each configuration is recorded with
``torch.profiler`` (``profile_memory=True``) and its allocation timeline
(``torch.profiler._memory_profiler.MemoryProfile``: every tensor allocation and free
through the c10 allocator) is replayed: the peak is the maximum, over the step, of the
bytes allocated since the step began and not yet freed -- activations, gradients,
temporaries, the monitors' per-row numbers and histograms.  For ``defaults`` that step
is one where both monitors run (their cadences set to hit it: the worst step).  On a
CUDA device ``torch.cuda.max_memory_allocated`` over the step is used instead.

    python benchmarks/overhead.py --widths 128 512 1024 --steps 10 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor.callbacks import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit

CONFIGS = ("plain", "every", "alternate", "defaults")
MEMORY_CONFIGS = ("plain", "every", "defaults")
LN_CADENCE = 50  # the recipe's log_every_n_steps = min(50, val_every)
PROBE_CADENCE = 250  # min(1000, val_every): the probe also runs after each validation


class StepTimer(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


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


HOOKS = (
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)


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
    if config == "plain":
        return []
    if config == "every":
        return [LayerNormMonitor(every_n_steps=1)]
    if config == "alternate":
        return [LayerNormMonitor(every_n_steps=2)]
    if cadence is None:
        return [LayerNormMonitor(), TimedProbe()]
    return [LayerNormMonitor(every_n_steps=cadence), TimedProbe(every_n_steps=cadence)]


def run_fit(recipe: Recipe, text: str, callbacks: list[Callback]) -> None:
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logger = TensorBoardLogger(folder, name="bench", default_hp_metric=False)
        fit(recipe, text, folder, logger=logger, callbacks=callbacks, progress=False, resume=False)


@dataclass
class WidthResult:
    width: int
    plain_ms: list[float] = field(default_factory=list)
    every: list[float] = field(default_factory=list)
    paired: list[float] = field(default_factory=list)
    unmeasured: list[float] = field(default_factory=list)
    idle_us: list[float] = field(default_factory=list)
    defaults: list[float] = field(default_factory=list)
    measured_extra_ms: list[float] = field(default_factory=list)
    probe_ms: list[float] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)


def gaps(starts: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(starts[warmup:], starts[warmup + 1 :], strict=False)]


def bench_width(width: int, args, text: str) -> WidthResult:
    heads = 4
    quick = {"limit_val_batches": 1}  # fit() validates once at the end: keep it short
    recipe = Recipe(width=width, heads=heads, max_steps=args.steps, batch_size=args.batch_size,
                    val_every=max(args.steps + 1, 250), seed=0, trainer_kwargs=quick)
    res = WidthResult(width)
    for rnd in range(args.rounds):
        times = {}
        k = rnd % len(CONFIGS)
        for config in CONFIGS[k:] + CONFIGS[:k]:  # rotate who goes first
            timer = StepTimer()
            cbs = callbacks_for(config)
            hook_time: dict[int, float] = {}
            if config == "defaults":
                for cb in cbs:
                    time_hooks(cb, hook_time)
            run_fit(recipe, text, [*cbs, timer])
            times[config] = (gaps(timer.starts, args.warmup), cbs, hook_time)
        plain = statistics.median(times["plain"][0])
        every = statistics.median(times["every"][0])
        alt = times["alternate"][0]  # gap i is step warmup + i; even steps are measured
        first = 0 if args.warmup % 2 == 0 else 1
        paired = statistics.median(
            alt[i] / ((alt[i - 1] + alt[i + 1]) / 2) for i in range(first or 2, len(alt) - 1, 2)
        )
        unmeasured = statistics.median(times["defaults"][0])  # steps >= warmup: none measured
        probe = times["defaults"][1][1].run_seconds
        t_probe = probe[-1] if probe else 0.0
        hooks = times["defaults"][2]
        # steps whose start and end both lie in the run (the hooks of step s fire partly
        # after global_step has become s + 1), excluding step 0 where both monitors run
        idle = statistics.median(hooks[k] for k in range(args.warmup + 1, args.steps - 1))
        res.plain_ms.append(1000 * plain)
        res.every.append(every / plain)
        res.paired.append(paired)
        res.unmeasured.append(unmeasured / plain)
        res.measured_extra_ms.append(1000 * (paired - 1) * plain)
        res.probe_ms.append(1000 * t_probe)
        res.idle_us.append(1e6 * idle)
        res.defaults.append(
            1 + (idle + (paired - 1) * plain / LN_CADENCE + t_probe / PROBE_CADENCE) / plain
        )
        print(f"  width {width} round {rnd + 1}: plain {1000 * plain:.1f} ms, every x{every / plain:.3f}, "
              f"paired x{paired:.3f}, defaults x{res.defaults[-1]:.4f} (unmeasured "
              f"x{unmeasured / plain:.3f}, idle {1e6 * idle:.0f} us, probe {1000 * t_probe:.0f} ms)",
              file=sys.stderr, flush=True)
    mem_recipe = Recipe(width=width, heads=heads, max_steps=3, batch_size=args.batch_size,
                        val_every=250, seed=0, trainer_kwargs=quick)
    for config in MEMORY_CONFIGS:
        probe = StepMemory(step=2)
        run_fit(mem_recipe, text, [probe, *callbacks_for(config, cadence=2)])  # probe first
        res.memory[config] = float(probe.peak)
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--steps", type=int, default=12, help="steps per fit (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: 32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.steps < args.warmup + 5:
        parser.error("--steps must be at least --warmup + 5 (the paired estimate needs them)")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (step 0 is where the default monitors run)")
    if args.threads:
        torch.set_num_threads(args.threads)
    text = load_corpus()
    results = [bench_width(w, args, text) for w in args.widths]
    med = statistics.median
    print(f"\ntrain-tiny recipe, batch {args.batch_size} x context 64, {args.steps} steps per fit "
          f"({args.warmup} warm-up), {args.rounds} interleaved rounds, torch threads "
          f"{torch.get_num_threads()}; ratios are medians over rounds of per-round ratios.\n")
    print("| width | plain ms/step | every step, paired | every step, direct | defaults (amortised) "
          "| defaults, unmeasured step, direct | idle hooks us/step | measured-step extra ms "
          "| invariance run ms | step peak MB plain | peak: every step "
          "| peak: defaults, both monitors firing |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        mem = r.memory
        print(f"| {r.width} | {med(r.plain_ms):.1f} | {med(r.paired):.3f}x | {med(r.every):.3f}x "
              f"| {med(r.defaults):.4f}x | {med(r.unmeasured):.3f}x | {med(r.idle_us):.0f} "
              f"| {med(r.measured_extra_ms):.1f} | {med(r.probe_ms):.0f} "
              f"| {mem['plain'] / 2**20:.1f} | {mem['every'] / mem['plain']:.3f}x "
              f"| {mem['defaults'] / mem['plain']:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
