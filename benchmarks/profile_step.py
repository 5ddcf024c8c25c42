"""Where a measured step's extra time goes: the operators that a measured step runs more of
than its unmeasured neighbour, from ``torch.profiler``.

    python benchmarks/profile_step.py --width 128 --threads 2

Fits the train-tiny recipe with ``LayerNormMonitor(every_n_steps=2)`` and profiles
``--pairs`` pairs of steps (a measured step and the unmeasured step after it); prints the
operators by the self CPU time the measured steps spend in them beyond the unmeasured ones
(median over the pairs), with the total extra time beside the step's own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from collections import defaultdict

import torch
from lightning.pytorch.callbacks import Callback
from torch.profiler import ProfilerActivity, profile

from lnmonitor.lightning import LayerNormMonitor
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit


class StepProfiles(Callback):
    """Self CPU microseconds per operator of each profiled step (``steps``)."""

    def __init__(self, steps: list[int]) -> None:
        self.steps, self.tables, self.totals = set(steps), {}, {}
        self._prof = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._close(trainer.global_step - 1)
        if trainer.global_step in self.steps:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self._close(trainer.global_step - 1)

    def _close(self, step: int) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        table = defaultdict(float)
        for event in self._prof.key_averages():
            table[event.key] += event.self_cpu_time_total
        self.tables[step], self.totals[step] = dict(table), sum(table.values())
        self._prof = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=4, help="measured/unmeasured step pairs (default 4)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    measured = [4 + 2 * i for i in range(args.pairs)]  # even steps are measured, after warm-up
    steps = measured + [s + 1 for s in measured]
    recipe = Recipe(width=args.width, depth=args.depth, max_steps=max(steps) + 2, val_every=10_000,
                    seed=0, trainer_kwargs={"limit_val_batches": 1})
    profiles = StepProfiles(steps)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(recipe, load_corpus(), folder,
            callbacks=[LayerNormMonitor(every_n_steps=2, summary=False, images=False), profiles],
            progress=False, resume=False)
    extra = defaultdict(list)
    for step in measured:
        on, off = profiles.tables[step], profiles.tables[step + 1]
        for key in on.keys() | off.keys():
            extra[key].append(on.get(key, 0.0) - off.get(key, 0.0))
    plain = statistics.median(profiles.totals[s + 1] for s in measured)
    total = statistics.median(profiles.totals[s] - profiles.totals[s + 1] for s in measured)
    print(f"width {args.width}, depth {args.depth}, torch threads {torch.get_num_threads()}: "
          f"unmeasured step {plain / 1000:.1f} ms of operator self time, measured step "
          f"+{total / 1000:.2f} ms (median over {args.pairs} pairs)")
    print(f"{'operator':<44} {'extra ms':>9} {'share':>7}")
    ranked = sorted(extra.items(), key=lambda kv: -statistics.median(kv[1]))
    for key, values in ranked[: args.top]:
        ms = statistics.median(values) / 1000
        share = f"{ms * 1000 / total:7.1%}" if total > 0 else ""
        print(f"{key[:44]:<44} {ms:9.3f} {share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
