"""What an unmeasured step costs at the defaults, in the training loop itself.

``findings_cost.py`` times the every-step growth watch's own work alone, in a tight loop, where its
operators and their data stay in the caches.  Inside a training step they do not: the same few
reductions run between the model's own operators.  So this steps three copies of one TinyGPT on the
same batches, a step each in turn (each in each place of the turn equally often): ``plain``, the
plain-loop door at its defaults (``LoopMonitor(model)``: the every-step growth watch and the
findings' read of it), the same handed each step's loss (``add_loss``: the loss rule's read) and
the same with ``findings=False`` (no watch), and reports, over the steps
neither door measures (not every 50th), the median of each door's extra time over the plain step of
its turn, and that against the plain step.  ``--parts`` adds two doors whose watch keeps its
hooks but does nothing in them, and whose watch computes but is never read, to split the watch's
cost into its hooks' dispatch, its reductions and the end-of-step read.

    python benchmarks/idle_step.py --shapes 64,2,12 64,4,32 128,4,32 --steps 600 [--parts]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import itertools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import lnmonitor.core.meter.meter as meter_module
from lnmonitor.core.meter.growth_watch import GrowthWatch
from lnmonitor.integrations.loop import LoopMonitor
from lnmonitor.tiny.model import GPTConfig, TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import shape  # noqa: E402

CONFIGS = ("plain", "defaults", "defaults, add_loss", "findings off")
PARTS = ("watch: hooks only", "watch: no read")


class HooksOnly(GrowthWatch):
    """The watch's two hooks, doing nothing: their dispatch alone."""

    def _on_first(self, module, args) -> None:
        return None

    def _on_last(self, module, args) -> None:
        return None


class NoRead(GrowthWatch):
    """The watch's hooks and reductions; the step's value never read (no host read, no findings)."""

    def take(self, step: int) -> None:
        self._max = self._first = None
        return None


def _door(model, config: str) -> LoopMonitor:
    watch = {"watch: hooks only": HooksOnly, "watch: no read": NoRead}.get(config, GrowthWatch)
    meter_module.GrowthWatch = watch  # the class the meter builds its watch from
    try:
        return LoopMonitor(model, images=False, summary=False, findings=config != "findings off")
    finally:
        meter_module.GrowthWatch = GrowthWatch


def row(width: int, depth: int, batch: int, steps: int, parts: bool) -> str:
    torch.manual_seed(0)
    base = TinyGPT(GPTConfig(vocab_size=65, width=width, depth=depth, heads=4, context=64))
    batches = torch.randint(65, (8, batch, 65))
    configs = CONFIGS + (PARTS if parts else ())
    models = {c: copy.deepcopy(base) for c in configs}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")  # the doors' notes: no writer, no probe batch
        doors = {c: _door(models[c], c) for c in configs[1:]}
    orders = list(itertools.permutations(configs))
    times: dict[str, list[float]] = {c: [] for c in configs}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):  # the doors' notes
        warnings.simplefilter("ignore")
        for i in range(steps):
            x = batches[i % len(batches)]
            for config in orders[i % len(orders)]:
                model, door = models[config], doors.get(config)
                t = time.perf_counter()
                if door is not None:
                    door.start(i)
                loss = model(x[:, :-1], x[:, 1:])[1]
                loss.backward()
                if config == "defaults, add_loss":
                    door.add_loss(loss)
                if door is not None:
                    door.stop()
                took = time.perf_counter() - t
                model.zero_grad(set_to_none=True)
                if i % 50:  # neither door measures this step
                    times[config].append(took)
    plain = statistics.median(times["plain"])
    extra = {c: statistics.median(a - b for a, b in zip(times[c], times["plain"], strict=True))
             for c in configs[1:]}
    return f"| {width} x {depth}, {batch} | {plain * 1e3:.2f} ms | " + " | ".join(
        f"+{extra[c] * 1e6:.0f} us ({1 + extra[c] / plain:.4f}x)" for c in configs[1:]) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=[(64, 2, 12), (64, 4, 32), (128, 4, 32)], type=shape,
                        help="width,depth,batch of each TinyGPT (context 64)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", action="store_true", help="also the watch's parts (see above)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.steps} steps a door, torch threads {args.threads}; forward and backward, no optimizer\n")
    columns = list(CONFIGS[1:]) + (list(PARTS) if args.parts else [])
    print("| width x depth, batch | plain step | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for width, depth, batch in args.shapes:
        print(row(width, depth, batch, args.steps, args.parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
