"""What the findings add to a measured step, timed directly.

The findings read figures the meter has already computed (:mod:`lnmonitor.core.findings`): no
tensor, no host sync.  This times :meth:`FindingsReader.read` on a real measured step of the
tiny GPT (the study's model, batch 32, one thread) next to that measured step and a plain one,
so the ratio stays readable on a loaded machine (``overhead.py``'s side-by-side step times do
not, there).

    python benchmarks/findings_cost.py
"""

from __future__ import annotations

import time

import torch

from lnmonitor.core.findings import FindingsReader
from lnmonitor.core.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT


def main(repeats: int = 5, reads: int = 2000) -> None:
    torch.set_num_threads(1)
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
    start = time.perf_counter()
    for _ in range(repeats):
        model(x, x)[1].backward()
    plain = (time.perf_counter() - start) / repeats
    reader = FindingsReader(warn=lambda _: None)
    start = time.perf_counter()
    for i in range(reads):
        reader.read(i, result)
    read = (time.perf_counter() - start) / reads
    print(f"plain step {plain * 1e3:.1f} ms, measured step {step * 1e3:.1f} ms, findings read "
          f"{read * 1e6:.1f} us: {read / step:.1e} of a measured step, {read / (50 * plain):.1e} of the "
          "50 steps between two measured ones at the default cadence")


if __name__ == "__main__":
    main()
