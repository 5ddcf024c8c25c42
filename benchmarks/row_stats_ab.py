"""A change to the step's fixed part, against the code before it, side by side in one process.

The fixed part of a measured step (``stop()``'s histograms and ``result()``'s read, about 3 ms
whatever the width, docs/performance.md) moves by tenths of a millisecond, far inside what this
shared machine's load does to whole steps or to runs taken in turn.  So this loads
``lnmonitor/core/meter/row_stats.py`` (with the quantiles of ``lnmonitor/core/maths/histograms.py``)
as they were at a git revision beside the working tree's, gives
both the same measured step's rows (a TinyGPT of depth 4, batch 32 x context 64), checks they
compute the same vector and statistics, and times :func:`histogram_rows` and :func:`read` of the two
in alternating order, pair by pair.  Reported: medians, and the median of the pairwise ratios
(new / old).

    python benchmarks/row_stats_ab.py --rev dcbc59e --widths 64 128 --pairs 1500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from lnmonitor.core.meter import row_stats as new
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import load_at_revision  # noqa: E402

MODULE = "lnmonitor/core/meter/row_stats.py"
HISTOGRAMS = "lnmonitor/core/maths/histograms.py"


def old_module(rev: str):
    """``row_stats`` as it was at ``rev``, reading with the histograms' quantiles as they were then."""
    load_at_revision(rev, HISTOGRAMS, "histograms_old")
    return load_at_revision(rev, MODULE, "row_stats_old",
                            ("from lnmonitor.core.maths.histograms import", "from histograms_old import"))


def step_rows(width: int):
    """One measured step's rows and the meter's layout."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65, width=width, depth=4, heads=4, context=64))
    x = torch.randint(0, 65, (32, 65))
    meter = LadderMeter(model, say=lambda _: None, warn=lambda *_: None, watch_growth=False)
    meter.start()
    model(x[:, :-1], x[:, 1:])[1].backward()
    meter.stop()
    meter.abort()
    meter.start()  # a second step: the roles known, no bypass rows (a step like every later one)
    model(x[:, :-1], x[:, 1:])[1].backward()
    meter._unhook()
    return meter._tap.collect(), meter.layout


def compare(old, width: int, pairs: int) -> list[str]:
    rows, layout = step_rows(width)
    a, b = new.histogram_rows(rows, layout, "cpu"), old.histogram_rows(rows, layout, "cpu")
    if not torch.equal(a, b):
        raise SystemExit("the two histogram_rows differ: not a like-for-like change")
    flat = a[: layout.max_end]  # one process: its vector is the merged one
    for x, y in zip(new.read(flat, layout, counts=False), old.read(flat, layout, counts=False), strict=True):
        if (x.var_median, x.ms_median, x.share_median, x.share_p90) != (y.var_median, y.ms_median,
                                                                          y.share_median, y.share_p90):
            raise SystemExit("the two reads differ: not a like-for-like change")
    calls = {"histogram_rows": (lambda m: m.histogram_rows(rows, layout, "cpu")),
             "read": (lambda m: m.read(flat, layout, counts=False))}
    lines = []
    for name, call in calls.items():
        times = {"old": [], "new": []}
        for i in range(pairs):
            for label, module in ((("old", old), ("new", new)) if i % 2 else (("new", new), ("old", old))):
                t = time.perf_counter()
                call(module)
                times[label].append(time.perf_counter() - t)
        ratio = statistics.median(n / o for o, n in zip(times["old"], times["new"], strict=True))
        lines.append(f"| {width} | `{name}` | {statistics.median(times['old']) * 1e6:.0f} us | "
                     f"{statistics.median(times['new']) * 1e6:.0f} us | {ratio:.3f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    old = old_module(args.rev)
    print(f"row_stats at {args.rev} (old) against the working tree (new), {args.pairs} pairs, "
          f"torch threads {args.threads}\n")
    print("| width | function | old (median) | new (median) | new / old (median of pairs) |")
    print("|---:|---|---:|---:|---:|")
    for width in args.widths:
        print("\n".join(compare(old, width, args.pairs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
