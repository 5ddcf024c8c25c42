"""What the findings add to training, side by side.

Two costs (docs/findings.md, "Cost"):

* **every step**: the ladder's growth on every training step (the meter's
  :class:`~lnmonitor.core.meter.growth_watch.GrowthWatch`: two forward pre-hooks, one on-device
  reduction each) and its reading (:func:`lnmonitor.core.findings.reader.every_step`).  Timed two ways:
  (a) whole training steps (forward, backward, AdamW, and the door's end-of-step call) of one model
  with the watch beside an identical copy without, interleaved block by block, as the median of
  the per-block ratios -- the honest whole, but on a shared machine its blocks scatter by
  +-10-20%, more than the watch costs; (b) the watch's own work, the two hooks on the step's real
  rung inputs and the end-of-step read, timed alone and divided by the plain step's median time:
  the same cost, resolved to a few microseconds;
* **measured steps**: :meth:`FindingsReader.read` of a measured step's figures (no tensor, no
  host sync), against that measured step.

The shapes: nanoGPT's smallest (2 layers, width 64, 2 heads, context 64, batch 12) and the tiny
model at width 64 and 128 (4 layers, context 64, batch 32), one torch thread.

    python benchmarks/findings_cost.py [--blocks 15] [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from lnmonitor.core.findings.reader import FindingsReader, every_step
from lnmonitor.core.meter.growth_watch import GrowthWatch
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT

SHAPES = {
    "nanoGPT smallest (2 x 64, batch 12)": (GPTConfig(width=64, depth=2, heads=2, context=64), 12),
    "tiny, width 64 (4 x 64, batch 32)": (GPTConfig(width=64, depth=4, heads=4, context=64), 32),
    "tiny, width 128 (4 x 128, batch 32)": (GPTConfig(width=128, depth=4, heads=4, context=64), 32),
}


def _trainer(model: TinyGPT, x: torch.Tensor, meter: LadderMeter | None, reader: FindingsReader | None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = [0]

    def step() -> None:
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counter[0] += 1
        if meter is not None:
            every_step(reader, meter, counter[0], lambda: None)

    return step


def every_step_ratio(config: GPTConfig, batch: int, blocks: int, steps: int) -> tuple[float, float, float]:
    """(median ratio watched / plain, its min, its max) over ``blocks`` interleaved blocks."""
    torch.manual_seed(0)
    plain_model = TinyGPT(config)
    watched_model = copy.deepcopy(plain_model)
    x = torch.randint(0, config.vocab_size, (batch, config.context))
    meter = LadderMeter(watched_model, say=lambda _: None)
    reader = FindingsReader(warn=lambda _: None)
    with meter.step():  # the fit's first measured step: the roles, the growth's start, the watch
        watched_model(x, x)[1].backward()
    reader.read(0, meter.result())
    watched_model.zero_grad(set_to_none=True)
    variants = [_trainer(plain_model, x, None, None), _trainer(watched_model, x, meter, reader)]
    for run in variants:  # warm-up
        for _ in range(steps):
            run()
    ratios = []
    for block in range(blocks):
        times = [0.0, 0.0]
        for k in ((0, 1) if block % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            for _ in range(steps):
                variants[k]()
            times[k] = time.perf_counter() - start
        ratios.append(times[1] / times[0])
    meter.close()
    return statistics.median(ratios), min(ratios), max(ratios)


def watch_ratio(config: GPTConfig, batch: int, repeats: int = 2000) -> tuple[float, float, float]:
    """(the watch's own microseconds per step, the plain step's milliseconds, 1 + their ratio):
    the two rungs' forwards on their real inputs of one step with the watch's hooks (and the
    door's end-of-step read) minus the same forwards without, the median of 7 interleaved pairs."""
    torch.manual_seed(0)
    model = TinyGPT(config)
    x = torch.randint(0, config.vocab_size, (batch, config.context))
    meter = LadderMeter(model, say=lambda _: None)
    reader = FindingsReader(warn=lambda _: None)
    with meter.step():
        model(x, x)[1].backward()
    reader.read(0, meter.result())
    meter.close()
    first, last = {}, {}
    h1 = model.blocks[0].ln1.register_forward_pre_hook(lambda m, a: first.__setitem__("x", a[0]))
    h2 = model.lnf.register_forward_pre_hook(lambda m, a: last.__setitem__("x", a[0]))
    plain = _trainer(model, x, None, None)
    for _ in range(5):
        plain()
    h1.remove()
    h2.remove()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(10):
            plain()
        times.append((time.perf_counter() - start) / 10)
    step = statistics.median(times)
    watch = GrowthWatch()
    ln1, lnf, a, b = model.blocks[0].ln1, model.lnf, first["x"], last["x"]

    def rungs(watched: bool) -> float:  # the two rungs' forwards (and the read), timed
        if watched:
            watch.attach(ln1, lnf)
        start = time.perf_counter()
        for i in range(repeats):
            ln1(a)
            lnf(b)
            if watched:
                reader.read_growth(*watch.take(i + 1))
        elapsed = (time.perf_counter() - start) / repeats
        watch.detach()
        return elapsed

    costs = [rungs(True) - rungs(False) for _ in range(7)]
    cost = statistics.median(costs)
    return cost * 1e6, step * 1e3, 1 + cost / step


def read_cost(repeats: int = 5, reads: int = 2000) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig())
    x = torch.randint(0, 65, (32, 64))
    meter = LadderMeter(model, say=lambda _: None)

    def measured():
        with meter.step():
            model(x, x)[1].backward()
        return meter.result()

    result = measured()
    start = time.perf_counter()
    for _ in range(repeats):
        result = measured()
    step = (time.perf_counter() - start) / repeats
    meter.close()
    reader = FindingsReader(warn=lambda _: None)
    start = time.perf_counter()
    for i in range(reads):
        reader.read(i, result)
    read = (time.perf_counter() - start) / reads
    print(f"findings read of a measured step: {read * 1e6:.1f} us, {read / step:.1e} of that measured step "
          f"({step * 1e3:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=15, help="interleaved blocks per shape")
    parser.add_argument("--steps", type=int, default=10, help="training steps per block")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| shape | plain step | the watch's own work per step | its ratio | whole steps, with / without: "
          "median (min to max) |")
    print("|---|---:|---:|---:|---|")
    for name, (config, batch) in SHAPES.items():
        own, step, ratio = watch_ratio(config, batch)
        median, low, high = every_step_ratio(config, batch, args.blocks, args.steps)
        print(f"| {name} | {step:.2f} ms | {own:.1f} us | {ratio:.4f}x "
              f"| {median:.4f}x ({low:.4f} to {high:.4f}) |", flush=True)
    read_cost()


if __name__ == "__main__":
    main()
