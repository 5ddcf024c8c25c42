"""The eps cost as training lost: how many steps the eps 1e-5 run needed to reach the loss the
eps 0.1 run ended at (docs/eps.md, "The cost as steps lost").

Definition (written before it was measured): for a pair of runs with the same seed, the
**delay at a budget** ``B`` is ``B`` minus the first step at which the eps 1e-5 run's validation
loss, linearly interpolated between its evaluations, is at or below the eps 0.1 run's validation
loss at ``B`` (itself interpolated).  In steps, and as a share of ``B``.  A budget is an
evaluation step of both runs.  Where the eps 0.1 run is *not* behind at ``B`` the table gives the
signed delay (:func:`signed_delay`): minus the steps the eps 0.1 run needed to reach the eps 1e-5
run's loss at ``B``, so a negative delay is steps eps 0.1 saved.

Budgets inside a longer run (step 1,000 of a 3,000-step run) are not runs of that length: the
one-cycle learning rate is still high there.  A cross-check on the training loss (logged every
50 steps, one batch each) smooths it with a trailing mean of a few logged points first.

Reads the records of ``lnmonitor eps-compare`` (``<out>/eps=<eps>/seed=<n>/result.json``, their
``val/loss`` and ``train/loss`` curves).  ``python -m research.eps.delay`` prints
the table; ``--folder`` reads other record sets.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Sequence
from pathlib import Path

from lnmonitor.core.output.files import read_json
from lnmonitor.core.output.metric_names import TRAIN_LOSS, VAL_LOSS
from research.eps import RECORDS, RESULTS

__all__ = ["BUDGETS", "RECORD_SETS", "at", "delay", "delays", "main", "markdown", "reach", "rows",
           "signed_delay", "smooth"]

Curve = Sequence[tuple[int, float]]

# the paired eps 0.1 / eps 1e-5 record sets, by what they are: GPT-2's initialisation (where eps
# dominates the first norm's variance: docs/eps.md), PyTorch's default initialisation as the
# control (eps 0.1 within 0.01 nats of 1e-5 there), and the runs trained to test the prediction
# (skipped while absent)
RECORD_SETS = {
    "LayerNorm, the Python help text": RESULTS / "eps-compare-gpt2-init",
    "RMSNorm, the Python help text": RECORDS / "law-oos/rms-4x128",
    "LayerNorm, the standard library's source": RECORDS / "law-oos/python-source-4x128",
    "LayerNorm, the standard library's source, its own 1,000-step schedule": RECORDS / "delay-source-1000",
    "LayerNorm, the Python help text, its own 1,000-step schedule": RECORDS / "delay-1000",
    "control: LayerNorm, the Python help text, PyTorch's default init": RESULTS / "eps-compare",
}
# step indices: the evaluation after 1,000, 2,000 and 3,000 optimizer steps
BUDGETS = (999, 1999, 2999)
SMOOTH = 5  # logged training losses (every 50 steps) in the trailing mean of the cross-check


def at(curve: Curve, step: float) -> float:
    """The curve's value at ``step``, linearly interpolated between its points."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    if len(curve) == 1 and curve[0][0] == step:
        return curve[0][1]
    raise ValueError(f"step {step} is outside the curve ({curve[0][0]} to {curve[-1][0]})")


def reach(curve: Curve, target: float) -> float | None:
    """The first step at which the interpolated curve is at or below ``target`` (None: never)."""
    if curve[0][1] <= target:
        return float(curve[0][0])
    for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False):
        if v1 <= target:
            return s1 - (s1 - s0) * (target - v1) / (v0 - v1) if v0 != v1 else float(s1)
    return None


def delay(small: Curve, large: Curve, budget: int) -> float | None:
    """The delay at ``budget`` (module docstring) of the eps 0.1 run ``large`` against the eps
    1e-5 run ``small``: ``budget`` minus the first step at which ``small`` is at or below
    ``large``'s loss at ``budget``; None when ``small`` never got as low by ``budget``."""
    target = at(large, budget)
    until = [(s, v) for s, v in small if s <= budget]
    step = reach(until, target)
    return None if step is None else budget - step


def signed_delay(small: Curve, large: Curve, budget: int) -> float:
    """:func:`delay` where the eps 0.1 run is behind at ``budget``; where it is not, minus the
    delay of the eps 1e-5 run against it (the steps eps 0.1 saved); 0 when they are level."""
    gap = at(large, budget) - at(small, budget)
    if gap > 0:
        return delay(small, large, budget)  # never None: small is below large's loss at budget
    if gap < 0:
        return -delay(large, small, budget)
    return 0.0


def smooth(curve: Curve, points: int = SMOOTH) -> list[tuple[int, float]]:
    """The trailing mean of ``points`` consecutive values (from the ``points``-th point on)."""
    return [(curve[i][0], statistics.fmean(v for _, v in curve[i + 1 - points:i + 1]))
            for i in range(points - 1, len(curve))]


def _curves(folder: Path, eps: str, name: str) -> dict[int, list[tuple[int, float]]]:
    return dict(_read(Path(folder), eps, name))


@functools.lru_cache(maxsize=64)
def _read(folder: Path, eps: str, name: str) -> tuple[tuple[int, list[tuple[int, float]]], ...]:
    out = {}
    for path in sorted(folder.glob(f"eps={eps}/seed=*/result.json")):
        record = read_json(path, "eps-compare record")
        if record.get("finished", True) and name in record["curves"]:
            out[int(record["seed"])] = [(int(s), float(v)) for s, v in record["curves"][name]]
    return tuple(out.items())


def delays(folder: Path, budgets: Sequence[int] = BUDGETS, curve: str = VAL_LOSS,
           points: int = 1) -> dict[int, dict[int, tuple[float, float]]]:
    """``{budget: {seed: (signed delay, nats gap at the budget)}}`` over the paired seeds of
    ``folder`` (eps 1e-5 and 0.1), on ``curve`` smoothed over ``points`` logged values, for the
    budgets that both runs of every pair reached."""
    small, large = _curves(folder, "1e-05", curve), _curves(folder, "0.1", curve)
    if points > 1:
        small = {s: smooth(c, points) for s, c in small.items()}
        large = {s: smooth(c, points) for s, c in large.items()}
    seeds = sorted(s for s in small.keys() & large.keys() if small[s] and large[s])
    out = {}
    for budget in budgets:
        if seeds and all(min(small[s][-1][0], large[s][-1][0]) >= budget for s in seeds):
            out[budget] = {s: (signed_delay(small[s], large[s], budget),
                               at(large[s], budget) - at(small[s], budget)) for s in seeds}
    return out


def _fmt(value: float, fmt: str) -> str:
    text = f"{value:{fmt}}"
    return text[1:] if text.startswith("-") and not text.strip("-+0.") else text  # no "-0"


def _spread(values: list[float], fmt: str, centre=statistics.median) -> str:
    return f"{_fmt(centre(values), fmt)} ({_fmt(min(values), fmt)} to {_fmt(max(values), fmt)})"


def rows(sets: dict[str, Path] = RECORD_SETS, budgets: Sequence[int] = BUDGETS) -> list[dict]:
    """One row per record set that is present and budget: the seeds' delays on the validation
    loss and on the smoothed training loss, their shares of the budget and the nats gaps."""
    out = []
    for name, folder in sets.items():
        val = delays(folder, budgets)
        train = delays(folder, budgets, TRAIN_LOSS, SMOOTH)
        for budget, by_seed in val.items():
            steps = [d for d, _ in by_seed.values()]
            out.append({"configuration": name, "budget": budget + 1, "seeds": sorted(by_seed),
                        "delays": steps, "shares": [d / (budget + 1) for d in steps],
                        "gaps": [g for _, g in by_seed.values()],
                        "train_delays": [d for d, _ in train.get(budget, {}).values()]})
    return out


def markdown(sets: dict[str, Path] = RECORD_SETS, budgets: Sequence[int] = BUDGETS) -> str:
    """Per record set and budget: the delay (median over seeds, range), as a share of the budget,
    the same on the smoothed training loss, and the nats gap (mean, range)."""
    lines = ["| configuration | seeds | budget (steps) | delay, steps: median (range) | share of the "
             "budget: median (range) | delay on the training loss, steps | gap at the budget, "
             "nats/char: mean (range) |", "|---|---:|---:|---|---|---|---|"]
    for row in rows(sets, budgets):
        train = _spread(row["train_delays"], ".0f") if row["train_delays"] else "-"
        lines.append(f"| {row['configuration']} | {len(row['seeds'])} | {row['budget']:,} | "
                     f"{_spread(row['delays'], '.0f')} | {_spread(row['shares'], '.2f')} | {train} | "
                     f"{_spread(row['gaps'], '+.3f', statistics.fmean)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The eps 0.1 cost as steps lost (docs/eps.md).")
    parser.add_argument("--folder", type=Path, action="append",
                        help="an eps-compare output folder with eps 1e-05 and 0.1 runs (repeatable; "
                             "default: the record sets of docs/eps.md)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS),
                        help="step indices to read the delay at (default: 999 1999 2999)")
    args = parser.parse_args(argv)
    sets = {str(f): f for f in args.folder} if args.folder else RECORD_SETS
    print(markdown(sets, args.budgets), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
