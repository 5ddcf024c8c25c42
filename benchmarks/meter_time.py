"""The meter's own time per measured step, timed directly, against the training step.

The step-time difference that ``overhead.py`` reports (measured step minus its unmeasured
neighbours) drowns in other tenants' load on a shared machine; this benchmark times the
meter's own work instead: the wall time inside its backward hooks (the passes over each
norm's rows), ``stop()`` (finishing the rows, the histograms) and ``result()`` (the one host
read, the figures), summed per measured step, next to the median unmeasured step (forward,
backward, AdamW) of the same plain loop.  It leaves out what timing cannot see (cache
effects of the hooks on the model's own operators) and the Lightning door's logging (about
0.3 ms a step), so it is a lower bound on the extra, and a stable one.

    python benchmarks/meter_time.py --widths 128 256 512 1024 2048 --depths 4 12 --threads 2 \\
        --figure benchmarks/results/meter_time_cpu.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import lnmonitor.core.meter.taps as taps
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT

VOCAB = 96
INSIDE = [0.0]  # seconds inside the hooks' work during the current step


def time_the_hooks() -> None:
    """Every hook's work (``NormTap._run``: the passes over a call's rows) adds its time to
    :data:`INSIDE`."""
    run = taps.NormTap._run

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        run(self, *args, **kwargs)
        INSIDE[0] += time.perf_counter() - t0

    taps.NormTap._run = timed


def cell(width: int, depth: int, steps: int, batch: int, context: int) -> tuple[float, float, int]:
    """(median plain step ms, median meter ms per measured step, norms) of one model."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, width=width, depth=depth, heads=4, context=context))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, VOCAB, (batch, context))
    meter, inside = LadderMeter(model, say=lambda _: None), INSIDE
    plain, own = [], []
    for i in range(steps):
        measured = i % 2 == 1
        inside[0] = 0.0
        t0 = time.perf_counter()
        if measured:
            meter.start()
        _, loss = model(x, x)
        loss.backward()
        t1 = time.perf_counter()
        if measured:
            meter.stop()
            meter.result().metrics()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i < 2:  # warm-up
            continue
        if measured:
            own.append(inside[0] + t2 - t1)
        else:
            plain.append(time.perf_counter() - t0)
    return 1000 * statistics.median(plain), 1000 * statistics.median(own), len(meter.norms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--steps", type=int, default=10, help="steps per model, half measured (default 10)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--figure", default=None, help="also draw meter / step against width (PNG)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    time_the_hooks()
    print(f"rows {args.batch_size * args.context} a step, torch threads {torch.get_num_threads()}")
    print("| width | depth | norms | plain step ms | meter ms per measured step | meter / step |")
    print("|---:|---:|---:|---:|---:|---:|")
    curves: dict[int, list[tuple[int, float]]] = {}
    for depth in args.depths:
        for width in args.widths:
            plain, own, norms = cell(width, depth, args.steps, args.batch_size, args.context)
            row = f"| {width} | {depth} | {norms} | {plain:.1f} | {own:.2f} | {own / plain:.2%} |"
            print(row, flush=True)
            curves.setdefault(depth, []).append((width, own / plain))
    if args.figure:
        draw(curves, args.figure, args.batch_size * args.context)
    return 0


def draw(curves: dict[int, list[tuple[int, float]]], path: str, rows: int) -> None:
    """The meter's time per measured step as a fraction of a step, against width, per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for depth, points in curves.items():
        widths, fractions = zip(*points, strict=True)
        ax.plot(widths, [100 * f for f in fractions], "o-", label=f"depth {depth}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1% of a step")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("width")
    ax.set_ylabel("meter time per measured step (% of a step)")
    ax.set_title(f"LayerNormMonitor's meter, every step, CPU, {rows} rows a step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
