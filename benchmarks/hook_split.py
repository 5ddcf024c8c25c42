"""How a measured step's hooks split into dispatch and arithmetic, side by side in one process.

The same TinyGPT forward and backward run in three ways, alternated pair by pair: ``plain`` (no
meter), ``hooks, no arithmetic`` (the meter's hooks on, their passes over the rows replaced by
nothing: what remains is the hooks' own dispatch, Python and keeping the tensors) and ``hooks``
(the measured step's hooks as they are).  Reported: the median over pairs of each one's extra time
over the plain pass beside it.  ``stop()`` and ``result()`` (the step's fixed part) are left out:
``benchmarks/meter_time.py`` times them.

    python benchmarks/hook_split.py --shapes 64,2,12 128,4,32 --pairs 300
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

MODES = ("plain", "hooks, no arithmetic", "hooks")


def split(width: int, depth: int, batch: int, pairs: int) -> dict[str, float]:
    """``{mode: median extra seconds over plain}`` and ``"plain"``: the plain pass's median."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65, width=width, depth=depth, heads=4, context=64))
    x = torch.randint(0, 65, (batch, 65))
    meter = LadderMeter(model, say=lambda _: None, warn=lambda *_: None, watch_growth=False)
    meter.start()  # the role-finding step, once, as a fit's first measured step
    model(x[:, :-1], x[:, 1:])[1].backward()
    meter.stop()
    meter.result()
    model.zero_grad(set_to_none=True)
    run = taps.NormTap._run

    def step(mode: str) -> float:
        if mode == "hooks, no arithmetic":
            taps.NormTap._run = lambda self, *a, **k: None
        try:
            t = time.perf_counter()
            if mode != "plain":
                meter.start()
            model(x[:, :-1], x[:, 1:])[1].backward()
            took = time.perf_counter() - t
            if mode != "plain":
                meter._unhook()
                meter._tap.collect()
        finally:
            taps.NormTap._run = run
        model.zero_grad(set_to_none=True)
        return took

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(pairs):
        for mode in MODES if i % 2 else MODES[::-1]:
            times[mode].append(step(mode))
    out = {"plain": statistics.median(times["plain"])}
    for mode in MODES[1:]:
        out[mode] = statistics.median(a - b for a, b in zip(times[mode], times["plain"], strict=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["64,2,12", "128,4,32"],
                        help="width,depth,batch of each TinyGPT (context 64)")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| width x depth, batch | forward + backward | hooks' dispatch | hooks' arithmetic |")
    print("|---|---:|---:|---:|")
    for shape in args.shapes:
        width, depth, batch = (int(v) for v in shape.split(","))
        s = split(width, depth, batch, args.pairs)
        dispatch, total = s["hooks, no arithmetic"], s["hooks"]
        print(f"| {width} x {depth}, {batch} | {s['plain'] * 1e3:.1f} ms | +{dispatch * 1e3:.2f} ms | "
              f"+{(total - dispatch) * 1e3:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
