"""How a measured step's cost grows with width and depth, and where its time goes.

Every width of ``--widths`` x depth of ``--depths`` is a cell: a TinyGPT (4 heads, ``--context``,
``--batch-size``, one fixed batch) stepped in a plain loop as the recipe steps it
(``stepping.train_step``: forward, backward, clipping, AdamW), with a ``LadderMeter`` measuring every
even step: ``start()`` before the forward, ``stop()`` and ``result().metrics()`` after the backward,
all a measured step computes without what a monitor adds (writing the metrics, a picture every 50
steps).  Two measures of a measured step's cost, from the same loop:

* *the meter timed directly*: the wall time inside its backward hooks' passes over the rows
  (``NormTap._run``), in ``stop()`` (finishing the rows, the histograms) and in ``result()`` (the one
  host read, the figures).  No subtraction of two noisy step times: a steady lower bound, which
  leaves out the hooks' dispatch and their cache effects on the model's own operators (on CUDA it
  is the host's time; the device's shows in the paired extra);
* *the paired extra*: a measured step against the mean of its two unmeasured neighbours
  (``stepping.paired``): the whole extra, within what other load does to steps a fraction of a
  second apart.

Then one periodic invariance run is timed (the default monitor's cases on its probe windows,
without the once-per-fit check); the defaults, without a monitor, are ``stepping.amortised``: ``1 +
(extra / 50 + run / 1000) / plain`` (a monitor's own time on unmeasured steps is overhead.py's and
small_models.py's).  Reported per cell, with exponents of the meter's time and of the extra
fitted against rows x width and the norm count, the width from which each depth stays under 1% of
a step, and with ``--figure`` both measures against width.
Cells run the least work first; one is skipped, saying why, when its estimated memory exceeds
``--memory`` or its time, estimated from the largest cell measured before it, exceeds
``--cell-budget`` even at the fewest steps (its steps are cut to the budget before that).

    python benchmarks/cost_model.py --widths 128 256 512 1024 2048 --depths 4 12 --threads 2 \\
        --figure benchmarks/results/cost_model_cpu.png --markdown cost_model.md
    python benchmarks/cost_model.py --widths 32 --depths 1 --steps 6 --batch-size 2 --context 8  # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import stepping
import torch

from lnmonitor.core.invariance.probe import InvarianceProbe
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.meter.taps import NormTap
from lnmonitor.lightning import FinalNormInvarianceMonitor


@dataclass
class Cell:
    """One cell: ``plain_ms`` the median unmeasured step; ``paired`` the median measured step /
    mean of its unmeasured neighbours; ``hooks_ms``, ``stop_ms``, ``result_ms`` the meter's own
    time per measured step (medians); ``probe_ms`` one periodic invariance run; ``loop_s`` the
    loop's wall time; ``skipped`` why the cell was not measured (empty when it was)."""

    width: int
    depth: int
    steps: int = 0
    plain_ms: float = math.nan
    paired: float = math.nan
    hooks_ms: float = math.nan
    stop_ms: float = math.nan
    result_ms: float = math.nan
    probe_ms: float = math.nan
    loop_s: float = math.nan
    skipped: str = ""

    @property
    def norms(self) -> int:
        return 2 * self.depth + 1  # ln1 and ln2 of each block, and the final norm

    @property
    def meter_ms(self) -> float:
        return self.hooks_ms + self.stop_ms + self.result_ms

    @property
    def extra_ms(self) -> float:
        return (self.paired - 1) * self.plain_ms

    @property
    def defaults(self) -> float:
        """The meter and the invariance probe at their defaults against a plain step (no monitor)."""
        return stepping.amortised(self.plain_ms, measured=self.extra_ms, probe=self.probe_ms)


@contextmanager
def hooks_timed(inside: list[float]):
    """While inside, every hook's passes over a call's rows (``NormTap._run``) add their seconds
    to ``inside[0]``."""
    run = NormTap._run

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    NormTap._run = timed
    try:
        yield
    finally:
        NormTap._run = run


def measure(width: int, depth: int, steps: int, args) -> Cell:
    """One cell (see the module docstring)."""
    model = stepping.tiny_gpt(width, depth, args.context, device=args.device)
    optimizer = stepping.adamw(model)
    tokens = stepping.token_batches(1, args.batch_size, args.context, args.device)[0]
    meter = LadderMeter(model, info=lambda _: None, warn=lambda *_: None)
    inside, parts = [0.0], []  # (hooks, stop, result) seconds of each measured step

    def start() -> None:
        inside[0] = 0.0
        meter.start()

    def stop(loss) -> None:
        t0 = time.perf_counter()
        meter.stop()
        t1 = time.perf_counter()
        result = meter.result()
        if result is not None:
            result.metrics()
        parts.append((inside[0], t1 - t0, time.perf_counter() - t1))

    with hooks_timed(inside):
        times = [stepping.train_step(model, optimizer, tokens, start, stop) if i % 2 == 0 else
                 stepping.train_step(model, optimizer, tokens) for i in range(steps)]
    if meter.off_reason:
        return Cell(width, depth, steps, skipped=f"the meter turned off: {meter.off_reason}")
    hooks, stops, results = zip(*parts[(args.warmup + 1) // 2:], strict=True)
    monitor = FinalNormInvarianceMonitor()
    probe = stepping.token_batches(1, monitor.probe_size, args.context, args.device)[0]
    prober = InvarianceProbe(model, final_norm="lnf", cases=monitor.cases, scales=monitor.scales)
    prober.checked = True  # the bypass check runs once per fit (a fixed cost), not at every run
    probe_s = timed(lambda: prober.run((probe[:, :-1], probe[:, 1:]), sweep=False), args.device)
    unmeasured = [t for i, t in enumerate(times) if i >= args.warmup and i % 2]
    ms = [1000 * statistics.median(x) for x in (hooks, stops, results)]
    return Cell(width, depth, steps, 1000 * statistics.median(unmeasured),
                stepping.paired(times[args.warmup:], args.warmup), *ms, 1000 * probe_s, sum(times))


def timed(call, device: str) -> float:
    """Seconds of ``call()``, synchronised on CUDA."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - t0


def work(width: int, depth: int, context: int) -> float:
    """Multiply-adds per token of a TinyGPT forward (weights, attention, head): a step's time
    grows with it, so a cell's time is estimated from a smaller cell's by this ratio."""
    return depth * (12 * width**2 + 2 * context * width) + stepping.VOCAB * width


def cell_bytes(width: int, depth: int, args) -> float:
    """A cell's memory, estimated (bytes): weights, gradients and AdamW's two moments in
    float32 (16 bytes a parameter), 24 float32 activations per token, block and unit of width
    kept for the backward, and 20% to spare."""
    params = 12 * depth * width**2 + (stepping.VOCAB + args.context) * width
    return 1.2 * (16 * params + 4 * 24 * args.batch_size * args.context * width * depth)


def first_paired(warmup: int) -> int:
    """The first measured (even) step whose two neighbours are timed."""
    return warmup + 1 if warmup % 2 else warmup + 2


def plan(width: int, depth: int, done: list[Cell], args) -> tuple[int, str]:
    """Steps for a cell, or 0 and why it is skipped (see the module docstring)."""
    need = cell_bytes(width, depth, args) / 2**30
    if need > args.memory:
        return 0, f"memory: ~{need:.0f} GiB estimated, over --memory {args.memory:.1f} GiB"
    if not done:
        return args.steps, ""
    ref = done[-1]
    scale = work(width, depth, args.context) / work(ref.width, ref.depth, args.context)
    step_s, probe_s = scale * ref.loop_s / ref.steps, scale * ref.probe_ms / 1000
    steps = min(args.steps, int((args.cell_budget - probe_s) / step_s))
    fewest = min(args.steps, first_paired(args.warmup) + 4)
    if steps < fewest:
        return 0, (f"time: ~{fewest * step_s + probe_s:.0f} s at {fewest} steps (from width {ref.width} "
                   f"depth {ref.depth}), over --cell-budget {args.cell_budget:g} s")
    return steps, ""


def sweep(args) -> list[Cell]:
    """Every cell, the least work first (see :func:`plan`); sorted by depth, then width."""
    grid = sorted(((w, d) for w in args.widths for d in args.depths), key=lambda wd: work(*wd, args.context))
    cells, done = [], []
    for width, depth in grid:
        steps, why = plan(width, depth, done, args)
        if not steps:
            cell = Cell(width, depth, skipped=why)
        else:
            try:
                cell = measure(width, depth, steps, args)
            except torch.OutOfMemoryError as err:
                torch.cuda.empty_cache()
                cell = Cell(width, depth, steps, skipped=f"out of memory ({str(err).splitlines()[0]})")
            if not cell.skipped:
                done.append(cell)
        cells.append(cell)
        said = (f"skipped, {cell.skipped}" if cell.skipped else
                f"{steps} steps, plain {cell.plain_ms:.1f} ms, meter {cell.meter_ms:.2f} ms, extra "
                f"{cell.extra_ms:.2f} ms, invariance run {cell.probe_ms:.0f} ms, loop {cell.loop_s:.0f} s")
        print(f"width {width} depth {depth}: {said}", file=sys.stderr, flush=True)
    return sorted(cells, key=lambda c: (c.depth, c.width))


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


def table(cells: list[Cell], args) -> str:
    """The markdown: one row per cell, the fitted exponents, where each depth falls under 1%."""
    rows = args.batch_size * args.context
    out = [f"{args.device}, {rows} rows a step (batch {args.batch_size} x context {args.context}), "
           f"{args.warmup} warm-up steps, torch threads {torch.get_num_threads()}, "
           f"torch {torch.__version__}.", "",
           "| width | depth | norms | rows x width | steps | plain ms/step | meter ms: hooks + stop + result "
           "| meter / step | paired extra ms | extra / step | defaults, no monitor | invariance run ms |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        head = f"| {c.width} | {c.depth} | {c.norms} | {rows * c.width:,} "
        if c.skipped:
            out.append(head + f"| - | skipped: {c.skipped} | | | | | | |")
            continue
        out.append(head + f"| {c.steps} | {c.plain_ms:.1f} | {c.meter_ms:.2f}: {c.hooks_ms:.2f} + "
                          f"{c.stop_ms:.2f} + {c.result_ms:.2f} | {c.meter_ms / c.plain_ms:.2%} "
                          f"| {c.extra_ms:.2f} | {c.paired - 1:.2%} | {c.defaults:.4f}x | {c.probe_ms:.0f} |")
    ran = [c for c in cells if not c.skipped]
    size, norms = [rows * c.width for c in ran], [c.norms for c in ran]

    def fitted(ys: list[float]) -> str:
        a = [f"{x:.2f}" if math.isfinite(x) else "?" for x in exponents([size, norms], ys)]
        return f"(rows x width)^{a[0]} x norms^{a[1]}"

    out += ["", f"Fitted over the {len(ran)} cells measured (?: not varied, or too few cells): the meter's "
            f"time grows as {fitted([c.meter_ms for c in ran])}, the paired extra as "
            f"{fitted([c.extra_ms for c in ran])} (negative extras left out), the training step as "
            f"{fitted([c.plain_ms for c in ran])}."]
    for depth in sorted({c.depth for c in ran}):
        line = [c for c in ran if c.depth == depth]
        under = [c.width for i, c in enumerate(line) if all(d.meter_ms < 0.01 * d.plain_ms for d in line[i:])]
        out.append(f"- depth {depth}: the meter's time is under 1% of a step from width {under[0]} on "
                   f"(measured up to {line[-1].width})." if under else
                   f"- depth {depth}: the meter's time stays at or above 1% of a step up to width "
                   f"{line[-1].width}.")
    return "\n".join(out) + "\n"


def figure(cells: list[Cell], path: Path, args) -> None:
    """PNG: the meter's time (solid) and the paired extra (dashed) as fractions of a training step
    against width, one colour per depth, log axes, with the 1% line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, depth in enumerate(sorted({c.depth for c in cells})):
        ran = [c for c in cells if c.depth == depth and not c.skipped]
        for ys, style, what in (([c.meter_ms / c.plain_ms for c in ran], "o-", "meter"),
                                ([c.paired - 1 for c in ran], "s--", "paired extra")):
            points = [(c.width, y) for c, y in zip(ran, ys, strict=True) if y > 0]
            if points:
                ax.plot(*zip(*points, strict=True), style, color=f"C{k}",
                        label=f"depth {depth} ({2 * depth + 1} norms), {what}")
    ax.axhline(0.01, color="grey", linestyle=":", linewidth=1, label="1% of a step")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    widths = sorted({c.width for c in cells})
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("width")
    ax.set_ylabel("measured step's cost / training step")
    ax.set_title(f"LayerNormMonitor, one measured step ({args.device}, batch {args.batch_size} x "
                 f"context {args.context})", fontsize=10)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 12, 24])
    parser.add_argument("--steps", type=int, default=16,
                        help="steps per cell, half measured; fewer where --cell-budget demands (default 16)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--cell-budget", type=float, default=900,
                        help="seconds a cell may take, estimated (default 900)")
    parser.add_argument("--memory", type=float, default=None,
                        help="GiB a cell may use, estimated (default: half the memory on CPU, which is "
                             "shared; 80%% of the GPU's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--figure", type=Path, default=None, help="also draw both measures here (PNG)")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--json", default=None, help="also write every cell's figures to this file")
    args = parser.parse_args(argv)
    if args.steps < first_paired(args.warmup) + 2:
        parser.error(f"--steps must be at least {first_paired(args.warmup) + 2} at --warmup {args.warmup} "
                     "(one measured step with both neighbours timed)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    stepping.set_threads(args.threads)
    if args.memory is None:
        args.memory = (0.8 * torch.cuda.get_device_properties(0).total_memory if args.device == "cuda"
                       else 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
    cells = sweep(args)
    text = table(cells, args)
    print("\n" + text)
    if args.figure:
        figure(cells, args.figure, args)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in cells], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
