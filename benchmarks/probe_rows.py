"""How many held-out windows the invariance probe needs: the scale sweep's spread across
disjoint sets of windows, and the time of one probe run, per number of windows.

    python benchmarks/probe_rows.py results/eps-compare/eps=1e-05/seed=0/checkpoints/last.ckpt

For each size N, the fixed held-out windows (evenly spaced over the held-out text) are
dealt into disjoint interleaved sets of N (set k: every (512/N)-th window from k), so each
set spans the whole text; each set is probed (the five cases and the sweep), and the
spread of the fitted slope and constant and of the signed scale-3 delta-loss across the
sets is printed with the seconds per probe.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from lnmonitor.core.invariance.measure import final_norm_invariance
from lnmonitor.core.norms.find import find_norms
from lnmonitor.tiny.checkpoint import load_checkpoint
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.data import CharDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--sets", type=int, default=4, help="disjoint sets per size (at most)")
    args = parser.parse_args()
    module, _ = load_checkpoint(args.checkpoint)
    context = module.config.context
    batches = CharDataModule(load_corpus(), vocab=module.vocab, context=context).val_batches()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    norms = find_norms(module)
    print(f"{len(x)} held-out windows of {context}; eps {module.hparams['eps']:g}")
    print("| windows | sets | slope mean | slope sd | constant sd/mean | scale-3 dloss sd/mean | "
          "fitted sets | s per probe |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        slopes, constants, scale3, seconds = [], [], [], []
        stride = len(x) // n
        for k in range(min(args.sets, stride)):
            part = (x[k::stride][:n], y[k::stride][:n])
            started = time.perf_counter()
            res = final_norm_invariance(module, part, norms=norms)
            seconds.append(time.perf_counter() - started)
            scale3.append(res.cases["scale_3"].dloss)
            if math.isfinite(res.slope):
                slopes.append(res.slope)
                constants.append(res.constant)
        s = np.asarray(slopes)
        c = np.asarray(constants)
        d = np.asarray(scale3)
        print(f"| {n} | {len(d)} | {s.mean() if s.size else math.nan:.3f} | "
              f"{s.std(ddof=1) if s.size > 1 else math.nan:.3f} | "
              f"{c.std(ddof=1) / c.mean() if c.size > 1 else math.nan:.2f} | "
              f"{d.std(ddof=1) / abs(d.mean()) if d.size > 1 else math.nan:.2f} | {s.size} | "
              f"{np.median(seconds):.3f} |")


if __name__ == "__main__":
    main()
