"""What the findings' own work costs: the every-step growth watch alone, and a measured step's read.

* **every step**: the ladder's growth watch (the meter's
  :class:`~lnmonitor.core.meter.growth_watch.GrowthWatch`: two forward pre-hooks, one on-device
  reduction each) and the monitor's end-of-step read (``FindingsReader.read_growth``): the two rungs'
  forwards on one step's real inputs with the watch and the read, less the same forwards without,
  taken in turns (``stepping.in_turns``), against the plain training step (``stepping.train_step``).
  The watch's work resolved to microseconds, with its operators and data in the caches; inside a
  training step it costs more (``small_models.py``: the defaults against ``findings off``);
* **measured steps**: ``FindingsReader.read`` of a measured step's figures (no tensor, no host
  sync), against that measured step.

    python benchmarks/findings_cost.py
    python benchmarks/findings_cost.py --shapes 16,1,2 --turns 2 --repeats 10  # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import stepping
import torch

from lnmonitor.core.findings.reader import FindingsReader
from lnmonitor.core.meter.growth_watch import GrowthWatch
from lnmonitor.core.meter.meter import LadderMeter


def measured(meter: LadderMeter, model: torch.nn.Module, tokens: torch.Tensor):
    """One measured forward and backward: its result (the gradients cleared after)."""
    with meter.step():
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    model.zero_grad(set_to_none=True)
    return meter.result()


def first_measured(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[LadderMeter, FindingsReader]:
    """A fit's first measured step (the roles, the growth's start), read by the findings."""
    meter, reader = LadderMeter(model, info=lambda _: None), FindingsReader(warn=lambda _: None)
    reader.read(0, measured(meter, model, tokens))
    return meter, reader


def watch_cost(width: int, depth: int, batch: int, turns: int, repeats: int) -> tuple[float, float]:
    """``(the watch's own seconds a step, the plain step's seconds)`` (see the module docstring)."""
    model, tokens = stepping.tiny_gpt(width, depth), stepping.token_batches(1, batch, 64)[0]
    meter, reader = first_measured(model, tokens)
    meter.close()
    ln1, lnf, inputs = model.blocks[0].ln1, model.lnf, {}
    handles = [m.register_forward_pre_hook(lambda m, a: inputs.__setitem__(m, a[0])) for m in (ln1, lnf)]
    optimizer = stepping.adamw(model)
    plain = [stepping.train_step(model, optimizer, tokens) for _ in range(13)][3:]  # 3 untimed
    for handle in handles:
        handle.remove()
    watch = GrowthWatch()

    def rungs(mode: str, turn: int) -> float:
        if mode == "watched":
            watch.attach(ln1, lnf)
        t0 = time.perf_counter()
        for i in range(repeats):
            ln1(inputs[ln1])
            lnf(inputs[lnf])
            if mode == "watched":
                reader.read_growth(*watch.take(i + 1))
        seconds = (time.perf_counter() - t0) / repeats
        watch.detach()
        return seconds

    times = stepping.in_turns(rungs, ("plain", "watched"), turns)
    return stepping.median_extra(times, "watched"), statistics.median(plain)


def read_cost(reads: int) -> tuple[float, float]:
    """``(one read's seconds, a measured step's)``: the tiny model's second measured step, read
    ``reads`` times."""
    model, tokens = stepping.tiny_gpt(128, 4), stepping.token_batches(1, 32, 64)[0]
    meter, reader = first_measured(model, tokens)
    t0 = time.perf_counter()
    result = measured(meter, model, tokens)
    step = time.perf_counter() - t0
    meter.close()
    t0 = time.perf_counter()
    for i in range(reads):
        reader.read(i + 1, result)
    return (time.perf_counter() - t0) / reads, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stepping.add_shapes(parser)
    parser.add_argument("--turns", type=int, default=7, help="turns of watched and plain rungs (default 7)")
    parser.add_argument("--repeats", type=int, default=2000,
                        help="rung forwards a turn, and reads (default 2000)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    stepping.set_threads(args.threads)
    print("| width x depth, batch | plain step | the watch's own work a step | its ratio |")
    print("|---|---:|---:|---:|")
    for width, depth, batch in args.shapes:
        own, step = watch_cost(width, depth, batch, args.turns, args.repeats)
        print(f"| {width} x {depth}, {batch} | {step * 1e3:.2f} ms | {own * 1e6:.1f} us "
              f"| {1 + own / step:.4f}x |", flush=True)
    read, step = read_cost(args.repeats)
    print(f"\nfindings read of a measured step: {read * 1e6:.1f} us, {read / step:.1e} of that measured step "
          f"({step * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
