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

import sys
from pathlib import Path

import lnmonitor.core.meter.taps as taps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import in_turns, measured_model, shapes_of, shapes_parser, timed_step  # noqa: E402

MODES = ("plain", "hooks, no arithmetic", "hooks")


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
