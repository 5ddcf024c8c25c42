"""What the plain-loop monitor costs a small model: the shapes a new user's first runs have.

For each of ``--shapes`` (width,depth,batch of a TinyGPT, context 64, 4 heads; by default nanoGPT's
smallest shape, 2 layers of 64 and batch 12, whose own model differs in biases and dropout, and the
tiny model, 4 layers, at widths 64 and 128 and batch 32), copies of one initialisation are stepped
on the same batches as nanoGPT's ``train.py`` steps (``stepping.train_step``), a step each in turn
(``stepping.in_turns``), each with the plain-loop monitor configured as:

* ``plain``: no monitor;
* ``every``: ``LoopMonitor(every_n_steps=1)``, no probe, pictures or summary: every step measured;
* ``defaults``: ``LoopMonitor(model)`` without a writer or a probe batch: step 0 and every 50th
  measured, the every-step growth watch between;
* ``add_loss``: the defaults handed each step's loss (``add_loss``: the loss rule's read);
* ``findings off``: the defaults with ``findings=False`` (no every-step watch).

Reported over the steps after ``--warmup``: a measured step's extra (``every``) and each default
monitor's extra on the steps it does not measure, each the median of its time less the plain step's of
the same turn; the defaults amortised over 50 steps, ``1 + (unmeasured extra + measured extra / 50)
/ plain``; the loop monitor's import time after torch (median of ``--import-runs`` fresh interpreters);
and the peak bytes of a measured step against a plain one (``stepping.PeakMemory``, after two steps).

    python benchmarks/small_models.py --steps 600 --threads 1
    python benchmarks/small_models.py --shapes 16,1,2 --steps 4 --warmup 1 --no-memory --import-runs 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import stepping
import torch

from lnmonitor.integrations.loop import LoopMonitor

MONITORS: dict[str, Callable[[torch.nn.Module], LoopMonitor]] = {
    "every": lambda model: LoopMonitor(model, every_n_steps=1, invariance_every_n_steps=None, images=False,
                                       summary=False, keep_history=False),
    "defaults": lambda model: LoopMonitor(model),
    "add_loss": lambda model: LoopMonitor(model),
    "findings off": lambda model: LoopMonitor(model, findings=False),
}
MODES = ("plain", *MONITORS)
IDLE = ("defaults", "add_loss", "findings off")  # the monitors measured on one step in 50


@dataclass
class Row:
    """One shape's figures: ``plain_ms`` the median plain step, ``measured_ms`` a measured step's
    extra, ``idle_us`` each default monitor's extra on an unmeasured step; peaks in MiB."""

    width: int
    depth: int
    batch: int
    steps: int
    plain_ms: float
    measured_ms: float
    idle_us: dict[str, float] = field(default_factory=dict)
    plain_peak_mb: float = math.nan
    measured_peak_mb: float = math.nan

    def amortised(self, monitor: str) -> float:
        """``monitor`` at its defaults, over 50 steps, against a plain step."""
        return stepping.amortised(self.plain_ms, self.idle_us[monitor] / 1000, self.measured_ms)


@contextlib.contextmanager
def quiet():
    """The monitors' notes (no writer, no probe batch, the end-of-run summary) kept off the output."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def stepper(base: torch.nn.Module, modes: tuple[str, ...], batches: torch.Tensor):
    """``(step, monitors)``: a copy of ``base`` with its optimizer and monitor per mode, and
    ``step(mode, i)`` taking training step ``i`` of one, in seconds."""
    models = {mode: copy.deepcopy(base) for mode in modes}
    optimizers = {mode: stepping.adamw(models[mode]) for mode in modes}
    monitors = {mode: MONITORS[mode](models[mode]) for mode in modes if mode in MONITORS}

    def step(mode: str, i: int) -> float:
        monitor, tokens = monitors.get(mode), batches[i % len(batches)]
        if monitor is None:
            return stepping.train_step(models[mode], optimizers[mode], tokens)

        def stop(loss: torch.Tensor) -> None:
            if mode == "add_loss":
                monitor.add_loss(loss)
            monitor.stop()

        return stepping.train_step(models[mode], optimizers[mode], tokens, lambda: monitor.start(i), stop)

    return step, monitors


def row(width: int, depth: int, batch: int, args) -> Row:
    """One shape, every mode stepped in turn (see the module docstring)."""
    base, batches = stepping.tiny_gpt(width, depth), stepping.token_batches(8, batch, 64)
    with quiet():
        step, monitors = stepper(base, MODES, batches)
        times = stepping.in_turns(step, MODES, args.steps)
        for monitor in monitors.values():
            monitor.close()
    timed = range(args.warmup, args.steps)
    unmeasured = [i for i in timed if i % stepping.LN_CADENCE]
    out = Row(width, depth, batch, args.steps, 1000 * statistics.median(times["plain"][args.warmup:]),
              1000 * stepping.median_extra(times, "every", timed),
              {monitor: 1e6 * stepping.median_extra(times, monitor, unmeasured) for monitor in IDLE})
    if args.memory:
        peaks = {}
        with quiet():
            step, monitors = stepper(base, ("plain", "every"), batches)
            for mode in ("plain", "every"):
                step(mode, 0)
                step(mode, 1)
                with stepping.PeakMemory() as memory:
                    step(mode, 2)
                peaks[mode] = memory.peak / 2**20
            monitors["every"].close()
        out.plain_peak_mb, out.measured_peak_mb = peaks["plain"], peaks["every"]
    return out


def import_seconds(runs: int) -> float:
    """Median wall time of importing the loop monitor after torch, each in a fresh interpreter."""
    code = ("import time, torch; t = time.perf_counter(); import lnmonitor.integrations.loop; "
            "print(time.perf_counter() - t)")

    def once() -> float:
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)

    return statistics.median(once() for _ in range(runs))


def table(rows: list[Row], import_s: float, args) -> str:
    """The markdown: one row per shape, extras as microseconds and as ratios to the plain step."""
    def extra(us: float, plain_ms: float) -> str:
        return f"{us:+.0f} us ({1 + us / 1000 / plain_ms:.4f}x)"

    out = [f"Plain loop, {args.steps} steps a mode ({args.warmup} untimed), torch threads "
           f"{torch.get_num_threads()}, torch {torch.__version__}; the loop monitor imports in "
           f"{import_s:.2f} s after torch.", "",
           "| width x depth, batch | plain step | measured step | unmeasured: defaults | defaults, add_loss "
           "| findings off | defaults, amortised | findings off, amortised | peak, plain / measured |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        idle = " | ".join(extra(r.idle_us[monitor], r.plain_ms) for monitor in IDLE)
        measured = extra(1000 * r.measured_ms, r.plain_ms)
        out.append(f"| {r.width} x {r.depth}, {r.batch} | {r.plain_ms:.2f} ms | {measured} | {idle} "
                   f"| {r.amortised('defaults'):.4f}x | {r.amortised('findings off'):.4f}x "
                   f"| {r.plain_peak_mb:.1f} / {r.measured_peak_mb:.1f} MiB |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stepping.add_shapes(parser)
    parser.add_argument("--steps", type=int, default=600, help="steps a mode (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the peak memory (the profiler takes seconds)")
    parser.add_argument("--import-runs", type=int, default=3,
                        help="fresh interpreters timing the loop monitor's import (default: %(default)s)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < args.warmup + 2:
        parser.error("--warmup must be at least 1 (step 0 is measured) and --steps at least --warmup + 2")
    stepping.set_threads(args.threads)
    rows = [row(width, depth, batch, args) for width, depth, batch in args.shapes]
    print(table(rows, import_seconds(args.import_runs), args))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
