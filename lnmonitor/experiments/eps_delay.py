"""The eps cost as training lost: how many steps the eps 1e-5 run needed to reach the loss the
eps 0.1 run ended at (docs/eps.md, "The cost as steps lost").

Definition (written before it was measured): for a pair of runs with the same seed, the
**delay at a budget** ``B`` is ``B`` minus the first step at which the eps 1e-5 run's validation
loss, linearly interpolated between its evaluations, is at or below the eps 0.1 run's validation
loss at ``B`` (itself interpolated); 0 when the eps 0.1 run is not behind at ``B``.  In steps,
and as a share of ``B``.  A budget is an evaluation step of both runs.  Reads the records of
``lnmonitor eps-compare`` (``<out>/eps=<eps>/seed=<n>/result.json``, their ``val/loss`` curve).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

from lnmonitor.core.files import read_json

__all__ = ["RECORD_SETS", "at", "delay", "delays", "main", "markdown", "reach"]

# the paired eps 0.1 / eps 1e-5 record sets at GPT-2's initialisation (where eps dominates the
# first norm's variance: docs/eps.md), by what they are
RECORD_SETS = {
    "LayerNorm, the Python help text": Path("results/eps-compare-gpt2-init"),
    "RMSNorm, the Python help text": Path("results/eps-law-oos/rms-4x128"),
    "LayerNorm, the standard library's source": Path("results/eps-law-oos/python-source-4x128"),
}
BUDGETS = (999, 1999, 2999)


def at(curve: Sequence[tuple[int, float]], step: float) -> float:
    """The curve's value at ``step``, linearly interpolated between its points."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    raise ValueError(f"step {step} is outside the curve ({curve[0][0]} to {curve[-1][0]})")


def reach(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """The first step at which the interpolated curve is at or below ``target`` (None: never)."""
    if curve[0][1] <= target:
        return float(curve[0][0])
    for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False):
        if v1 <= target:
            return s1 - (s1 - s0) * (target - v1) / (v0 - v1) if v0 != v1 else float(s1)
    return None


def delay(small: Sequence[tuple[int, float]], large: Sequence[tuple[int, float]],
          budget: int) -> float | None:
    """The delay at ``budget`` (module docstring) of the eps 0.1 run ``large`` against the eps
    1e-5 run ``small``; None when ``small`` never got as low by ``budget``."""
    target = at(large, budget)
    until = [(s, v) for s, v in small if s <= budget]
    step = reach(until, target)
    return None if step is None else max(budget - step, 0.0)


def _curves(folder: Path, eps: str) -> dict[int, list[tuple[int, float]]]:
    out = {}
    for path in sorted(folder.glob(f"eps={eps}/seed=*/result.json")):
        record = read_json(path, "eps-compare record")
        out[int(record["seed"])] = [(int(s), float(v)) for s, v in record["curves"]["val/loss"]]
    return out


def delays(folder: Path, budgets: Sequence[int] = BUDGETS) -> dict[int, list[tuple[float | None, float]]]:
    """``{budget: [(delay, nats gap at the budget), ...]}`` over the paired seeds of ``folder``."""
    small, large = _curves(folder, "1e-05"), _curves(folder, "0.1")
    seeds = sorted(small.keys() & large.keys())
    return {b: [(delay(small[s], large[s], b), at(large[s], b) - at(small[s], b)) for s in seeds]
            for b in budgets}


def markdown(sets: dict[str, Path] = RECORD_SETS, budgets: Sequence[int] = BUDGETS) -> str:
    """Per record set and budget: the delay (median over seeds, range), as a share of the budget,
    and the nats gap (mean, range)."""
    lines = ["| configuration | seeds | budget (steps) | delay, steps: median (range) | share of the "
             "budget | gap at the budget, nats/char: mean (range) |", "|---|---:|---:|---|---:|---|"]
    for name, folder in sets.items():
        for budget, pairs in delays(folder, budgets).items():
            steps = [d for d, _ in pairs if d is not None]
            gaps = [g for _, g in pairs]
            never = len(pairs) - len(steps)
            shown = f"{statistics.median(steps):.0f} ({min(steps):.0f} to {max(steps):.0f})" if steps else "-"
            if never:
                shown += f"; {never} never reached"
            share = f"{statistics.median(steps) / (budget + 1):.2f}" if steps else "-"
            lines.append(f"| {name} | {len(pairs)} | {budget + 1:,} | {shown} | {share} | "
                         f"{statistics.fmean(gaps):+.3f} ({min(gaps):+.3f} to {max(gaps):+.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description="The eps 0.1 cost as steps lost (docs/eps.md).").parse_args(argv)
    print(markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
