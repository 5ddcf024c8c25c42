"""The statistics of an eps comparison: Student-t 95% intervals across seeds (undefined, not invented, with
one seed), the loss difference paired by seed (same seed, same initialisation and batches) and a verdict
that claims no more than its interval."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lnmonitor.experiments.eps.store import eps_label

__all__ = ["CONFIDENCE", "LOG_SCALE", "aggregate", "interval", "paired_difference", "verdict"]

CONFIDENCE = 0.95


def interval(values: Sequence[float], confidence: float = CONFIDENCE, log: bool = False) -> dict:
    """``{"n", "mean", "sd", "half_width", "lo", "hi", "log"}``: mean and two-sided Student-t interval of the
    finite ``values``; all but ``n`` and ``mean`` are None below two values.  With ``log`` (for a quantity
    positive by nature) it is computed on the logarithms of the positive values: ``mean`` is the geometric
    mean, ``lo``/``hi`` its multiplicative interval, ``sd`` and ``half_width`` in log units."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)],
                   dtype=float)
    n = int(x.size)
    out = {"n": n, "mean": None, "sd": None, "half_width": None, "lo": None, "hi": None, "log": log}
    if n == 0:
        return out
    y = np.log(x) if log else x
    mean = float(y.mean())
    out["mean"] = math.exp(mean) if log else mean
    if n >= 2:
        from scipy import stats  # here, not at the top: the command line's --help imports this module

        sd = float(y.std(ddof=1))
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
        lo, hi = (math.exp(mean - half), math.exp(mean + half)) if log else (mean - half, mean + half)
        out.update(sd=sd, half_width=half, lo=lo, hi=hi)
    return out


def paired_difference(records: dict, eps: float, base: float, key: str = "val_loss") -> dict:
    """``headline[key]`` at ``eps`` minus at ``base``, paired by seed, with its t interval."""
    seeds = sorted(s for (e, s) in records if e == eps and (base, s) in records)
    diffs, used = [], []
    for seed in seeds:
        a = records[(eps, seed)]["headline"].get(key)
        b = records[(base, seed)]["headline"].get(key)
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            diffs.append(a - b)
            used.append(seed)
    result = interval(diffs)
    result.update(eps=eps, baseline_eps=base, seeds=used, differences=diffs)
    base_mean = interval([records[(base, s)]["headline"].get(key) for s in used])["mean"]
    result["relative"] = (result["mean"] / base_mean) if result["mean"] is not None and base_mean else None
    result["verdict"] = verdict(result)
    return result


def verdict(diff: dict) -> str:
    """Plain words for a paired loss difference that claim no more than its interval allows."""
    e, b = eps_label(diff["eps"]), eps_label(diff["baseline_eps"])
    n, d, h = diff["n"], diff["mean"], diff["half_width"]
    if n == 0:
        return f"eps={e}: no seed has finished at both eps={e} and eps={b} yet: nothing to compare."
    if h is None:
        return (f"eps={e} minus eps={b}: {d:+.4f} nats/char from a single seed. A 95% interval needs at "
                "least two seeds, so no difference is resolved at this number of seeds.")
    pct = f", {abs(diff['relative']) * 100:.1f}% of the eps={b} loss" if diff.get("relative") else ""
    span = f"95% interval {diff['lo']:+.4f} to {diff['hi']:+.4f}, {n} paired seeds"
    if diff["lo"] > 0:
        return f"eps={e} is worse than eps={b} by {d:.4f} +/- {h:.4f} nats/char{pct} ({span})."
    if diff["hi"] < 0:
        return f"eps={e} is better than eps={b} by {-d:.4f} +/- {h:.4f} nats/char{pct} ({span})."
    return (f"No difference resolved at this number of seeds: eps={e} minus eps={b} is "
            f"{d:+.4f} +/- {h:.4f} nats/char ({span}; the interval includes 0).")


# headline figures that are positive by nature: their intervals are computed on log scale
LOG_SCALE = ("scale_constant", "out_residual_scale_3", "final_eps_over_var", "final_transmission",
             "first_transmission", "max_transmission")


def aggregate(records: dict, eps_values: Sequence[float]) -> dict:
    """Per eps, the interval of every headline figure across the seeds present (:data:`LOG_SCALE` on logs)."""
    out = {}
    for eps in eps_values:
        runs = [r for (e, _), r in sorted(records.items()) if e == eps]
        keys = sorted({k for r in runs for k in r.get("headline", {})})
        out[eps_label(eps)] = {
            "eps": eps,
            "seeds": [r["seed"] for r in runs],
            "figures": {k: interval([r["headline"].get(k) for r in runs], log=k in LOG_SCALE) for k in keys},
        }
    return out
