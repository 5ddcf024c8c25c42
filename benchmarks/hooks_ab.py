"""The measured step's hooks against the code before them, side by side in one process.

A change to the taps' Python moves a small model's measured step by tenths of a millisecond, far
inside what this shared machine's load does to runs taken in turn.  So this loads
``lnmonitor/core/meter/taps.py`` and the reductions it calls (``lnmonitor/core/maths/reductions.py``)
as they were at a git revision beside the working tree's, runs the same TinyGPT forward and backward
with each revision's :class:`NormTap` on the meter's norms and with none (plain), in turn (each in each
place of the turn equally often), checks the two taps leave the same rows to the bit, and reports each
one's extra time over the plain pass of its turn (medians over turns) and their ratio.  The same code
on both sides reads 0.94x to 1.08x: this machine's noise floor for the ratio.  ``stop()`` and
``result()`` are left out (``row_stats_ab.py`` compares those).

    python benchmarks/hooks_ab.py --rev HEAD --shapes 64,2,12 128,4,32 --pairs 400
"""

from __future__ import annotations

import sys

import torch

from lnmonitor.core.meter.taps import NormTap

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from side_by_side import in_turns, load_at_revision, measured_model, shapes_of, shapes_parser, timed_step  # noqa: E402

TAPS = "lnmonitor/core/meter/taps.py"
REDUCTIONS = "lnmonitor/core/maths/reductions.py"


def old_tap_class(rev: str):
    """``NormTap`` as it was at ``rev``, with the reductions as they were then."""
    load_at_revision(rev, REDUCTIONS, "reductions_old")
    return load_at_revision(rev, TAPS, "taps_old", ("from lnmonitor.core.maths.reductions import",
                                         "from reductions_old import")).NormTap


def compare(old_cls, width: int, depth: int, batch: int, pairs: int) -> str:
    model, x, meter = measured_model(width, depth, batch)
    own = meter._tap
    taps = {"new": NormTap(own.norms), "old": old_cls(own.norms)}  # both fresh, alike

    def step(mode: str) -> tuple[float, object]:
        if mode == "plain":
            return timed_step(model, x, None)
        meter._tap = taps[mode]
        return timed_step(model, x, meter)

    new_rows, old_rows = step("new")[1], step("old")[1]
    if not (torch.equal(new_rows.data, old_rows.data) and new_rows.records == old_rows.records):
        raise SystemExit("the two taps leave different rows: not a like-for-like change")
    plain, extra = in_turns(lambda mode: step(mode)[0], ("plain", "old", "new"), pairs)
    meter._tap = own
    return (f"| {width} x {depth}, {batch} | {plain * 1e3:.1f} ms | "
            f"+{extra['old'] * 1e3:.2f} ms | +{extra['new'] * 1e3:.2f} ms | "
            f"{extra['new'] / extra['old']:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = shapes_parser(__doc__, 400)
    parser.add_argument("--rev", required=True, help="the git revision to compare the working tree with")
    args = parser.parse_args(argv)
    shapes = shapes_of(args)
    old_cls = old_tap_class(args.rev)
    print(f"the taps at {args.rev} (old) against the working tree (new), {args.pairs} pairs, "
          f"torch threads {args.threads}\n")
    print("| width x depth, batch | forward + backward | hooks, old | hooks, new | new / old |")
    print("|---|---:|---:|---:|---:|")
    for width, depth, batch in shapes:
        print(compare(old_cls, width, depth, batch, args.pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
