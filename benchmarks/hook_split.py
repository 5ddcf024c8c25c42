"""How a measured step's hooks split into dispatch and arithmetic, side by side in one process.

The same TinyGPT forward and backward run in three ways, in turn (each in each place of the turn
equally often): ``plain`` (no
meter), ``hooks, no arithmetic`` (the meter's hooks on, their passes over the rows replaced by
nothing: what remains is the hooks' own dispatch, Python and keeping the tensors) and ``hooks``
(the measured step's hooks as they are).  Reported: the median over turns of each one's extra time
over the plain pass of its turn.  ``stop()`` and ``result()`` (the step's fixed part) are left out:
``benchmarks/meter_time.py`` times them.

    python benchmarks/hook_split.py --shapes 64,2,12 128,4,32 --pairs 300
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

import lnmonitor.core.meter.taps as taps
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT

MODES = ("plain", "hooks, no arithmetic", "hooks")


def measured_model(width: int, depth: int, batch: int) -> tuple[TinyGPT, torch.Tensor, LadderMeter]:
    """A TinyGPT (context 64), a batch and a meter past its role-finding step, as a fit's first
    measured step leaves them (every later measured step is like the ones timed here)."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65, width=width, depth=depth, heads=4, context=64))
    x = torch.randint(0, 65, (batch, 65))
    meter = LadderMeter(model, say=lambda _: None, warn=lambda *_: None, watch_growth=False)
    meter.start()
    model(x[:, :-1], x[:, 1:])[1].backward()
    meter.stop()
    meter.result()
    model.zero_grad(set_to_none=True)
    return model, x, meter


def timed_step(model: TinyGPT, x: torch.Tensor, meter: LadderMeter | None,
               collect_timed: bool = False) -> tuple[float, object]:
    """One forward and backward, in seconds: plain (``meter`` None) or measured by ``meter``'s taps,
    whose rows are collected after it (inside the time with ``collect_timed``) and returned."""
    t = time.perf_counter()
    if meter is not None:
        meter.start()
    model(x[:, :-1], x[:, 1:])[1].backward()
    took = time.perf_counter() - t
    rows = None
    if meter is not None:
        meter._unhook()
        rows = meter._tap.collect()
        if collect_timed:
            took = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    return took, rows


def in_turns(step: Callable[[str], float], modes: Sequence[str],
             turns: int) -> tuple[float, dict[str, float]]:
    """``step(mode)`` for every mode, ``turns`` times, each mode in each place of the turn equally
    often: the median of ``modes[0]`` (the plain one) and each other mode's median extra time over
    the plain step of its turn."""
    orders = list(itertools.permutations(modes))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(turns):
        for mode in orders[i % len(orders)]:
            times[mode].append(step(mode))
    plain = times[modes[0]]
    extra = {m: statistics.median(a - b for a, b in zip(times[m], plain, strict=True)) for m in modes[1:]}
    return statistics.median(plain), extra


def shapes_parser(doc: str, pairs: int) -> argparse.ArgumentParser:
    """The arguments of the benchmarks that step TinyGPTs in turn: ``--shapes`` (width,depth,batch),
    ``--pairs`` (turns) and ``--threads``; call :func:`shapes_of` on what it parsed."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["64,2,12", "128,4,32"],
                        help="width,depth,batch of each TinyGPT (context 64)")
    parser.add_argument("--pairs", type=int, default=pairs)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def shapes_of(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """The parsed ``--shapes``, with ``--threads`` applied to torch."""
    torch.set_num_threads(args.threads)
    return [tuple(int(v) for v in shape.split(",")) for shape in args.shapes]


def split(width: int, depth: int, batch: int, pairs: int) -> dict[str, float]:
    """``{mode: median extra seconds over plain}`` and ``"plain"``: the plain pass's median."""
    model, x, meter = measured_model(width, depth, batch)
    run = taps.NormTap._run

    def step(mode: str) -> float:
        if mode == "hooks, no arithmetic":
            taps.NormTap._run = lambda self, *a, **k: None
        try:
            return timed_step(model, x, None if mode == "plain" else meter)[0]
        finally:
            taps.NormTap._run = run

    plain, extra = in_turns(step, MODES, pairs)
    return {"plain": plain, **extra}


def main(argv: list[str] | None = None) -> int:
    args = shapes_parser(__doc__, 300).parse_args(argv)
    print("| width x depth, batch | forward + backward | hooks' dispatch | hooks' arithmetic |")
    print("|---|---:|---:|---:|")
    for width, depth, batch in shapes_of(args):
        s = split(width, depth, batch, args.pairs)
        dispatch, total = s["hooks, no arithmetic"], s["hooks"]
        print(f"| {width} x {depth}, {batch} | {s['plain'] * 1e3:.1f} ms | +{dispatch * 1e3:.2f} ms | "
              f"+{(total - dispatch) * 1e3:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
