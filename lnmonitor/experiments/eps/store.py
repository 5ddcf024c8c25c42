"""Files of an eps comparison under ``<out>``, all written atomically: the merged ``results.json`` (with
``report.md`` and the PNGs rebuilt from the records), and per finished run
``eps=<eps>/seed=<seed>/result.json`` (its presence means finished) beside its checkpoints and event files.

A record of format ``/2`` holds the meter's ``metrics`` and the norms' roles (``rungs``, ``final_norm``,
``norm_info``); one of format ``/1`` (the stored grids under ``results/``) a hand-built ``norms`` table, every
norm a rung.  Only :func:`norm_value`, :func:`record_rungs`, :func:`record_final` and :func:`share_baseline`
read either.  Imports only the standard library (``lnmonitor report`` needs no torch).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from lnmonitor.core.output.files import read_json
from lnmonitor.core.output.metric_names import baseline_metric, per_norm
from lnmonitor.errors import UsageError

__all__ = [
    "RECORD_FORMAT", "RECORD_FORMATS", "RECORD_NAME", "RESULTS_FORMAT", "RESULTS_NAME", "check_config",
    "config_differences", "eps_label", "grid_pairs", "load_results", "norm_value", "read_record",
    "record_final", "record_norms", "record_rungs", "run_dir", "scan_records", "share_baseline",
]

RESULTS_NAME = "results.json"
RECORD_NAME = "result.json"
RESULTS_FORMAT = "lnmonitor.eps-compare.results/1"
RECORD_FORMAT = "lnmonitor.eps-compare.run/2"
# every record format this lnmonitor reads: /1 (a hand-built norms table) and /2 (the metrics)
RECORD_FORMATS = ("lnmonitor.eps-compare.run/1", RECORD_FORMAT)

_EPS_DIR = re.compile(r"^eps=(.+)$")
_SEED_DIR = re.compile(r"^seed=(\d+)$")


def eps_label(eps: float) -> str:
    """Canonical text of an eps: the shortest repr that round-trips (``1e-05``, ``0.1``)."""
    return repr(float(eps))


def run_dir(out: Path, eps: float, seed: int) -> Path:
    return Path(out) / f"eps={eps_label(eps)}" / f"seed={int(seed)}"


def _flatten(obj, prefix: str = "") -> dict:
    if not isinstance(obj, dict):
        return {prefix: obj}
    out = {}
    for key, value in obj.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_differences(expected: dict, found: dict) -> list[str]:
    """``key=<there> there, <now> now`` for each (dotted) key whose values differ."""
    want, have = _flatten(expected), _flatten(found)
    lines = []
    for key in sorted(set(want) | set(have)):
        a, b = have.get(key, "<absent>"), want.get(key, "<absent>")
        if a != b:
            lines.append(f"{key}={a!r} there, {b!r} now")
    return lines


def check_config(found: dict | None, expected: dict, where: Path) -> None:
    """UsageError naming the differences when ``found``, the configuration in ``where``, differs."""
    if found != expected:
        diffs = config_differences(expected, found or {})
        shown = "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "")
        raise UsageError(f"{str(where)!r} is from a different configuration ({shown}): "
                         "use the same options, or pass another --out")


def load_results(out: Path) -> dict | None:
    """The merged ``results.json`` under ``out``, None when absent; UsageError when corrupt."""
    path = Path(out) / RESULTS_NAME
    if not path.exists():
        return None
    results = read_json(path, "results file")
    if results.get("format") != RESULTS_FORMAT or not isinstance(results.get("config"), dict):
        raise UsageError(f"results file {str(path)!r} is not an eps-compare results file (format "
                         f"{results.get('format')!r}, expected {RESULTS_FORMAT!r}); move it away or choose "
                         "another --out")
    grid = results.get("grid")
    if not (isinstance(grid, dict) and (isinstance(grid.get("pairs"), list)
                                        or all(isinstance(grid.get(k), list) for k in ("eps", "seeds")))):
        raise UsageError(f"results file {str(path)!r} is corrupt (no eps/seed grid); move it away")
    return results


def read_record(path: Path, config: dict) -> dict:
    """A run record, checked against the experiment's configuration."""
    record = read_json(path, "run record")
    if record.get("format") not in RECORD_FORMATS:
        raise UsageError(f"run record {str(path)!r} has format {record.get('format')!r}, expected one of "
                         f"{', '.join(map(repr, RECORD_FORMATS))}; move it away (the run will be redone)")
    check_config(record.get("config"), config, path)
    for key in ("eps", "seed", "steps", "val_loss"):
        if key not in record:
            raise UsageError(f"run record {str(path)!r} is corrupt (no {key!r}); move it away to redo it")
    eps, seed = record["eps"], record["seed"]
    if path.parent != run_dir(path.parent.parent.parent, eps, seed):
        raise UsageError(f"run record {str(path)!r} says eps={eps!r} seed={seed!r}, which is not its folder; "
                         "move it away")
    return record


def scan_records(out: Path, config: dict) -> dict[tuple[float, int], dict]:
    """Every run record under ``out`` (any eps, any seed), keyed by ``(eps, seed)``."""
    records: dict[tuple[float, int], dict] = {}
    eps_dirs = sorted(Path(out).iterdir()) if Path(out).is_dir() else []
    for eps_dir in (d for d in eps_dirs if d.is_dir() and _EPS_DIR.match(d.name)):
        for seed_dir in sorted(eps_dir.iterdir()):
            path = seed_dir / RECORD_NAME
            if seed_dir.is_dir() and _SEED_DIR.match(seed_dir.name) and path.is_file():
                record = read_record(path, config)
                records[(float(record["eps"]), int(record["seed"]))] = record
    return records


def grid_pairs(eps: Iterable[float], seeds: Iterable[int]) -> list[tuple[float, int]]:
    """All (eps, seed) pairs, eps-major, in the order given."""
    seeds = list(seeds)
    return [(float(e), int(s)) for e in eps for s in seeds]


def record_norms(record: dict) -> list[str]:
    """The record's norms, in the order the forward calls them."""
    return list(record.get("norm_order") or record.get("norm_info") or record.get("norms") or [])


def record_rungs(record: dict) -> list[str]:
    """The ladder's rungs in forward order, the final norm last (a /1 record: every norm, in call order)."""
    rungs = record.get("rungs")
    return list(rungs) if rungs is not None else record_norms(record)


def record_final(record: dict) -> str | None:
    """The final norm (the last residual-stream norm to run; a /1 record's last norm to run)."""
    if "final_norm" in record:
        return record["final_norm"]
    names = record_norms(record)
    return names[-1] if names else None


def norm_value(record: dict, name: str | None, statistic: str) -> float | None:
    """The held-out ``statistic`` (``inv_sigma``, ``transmission``, ``share_median``, ...) of norm ``name``
    logged as ``lnmonitor/<statistic>/<name>``; None when the record has none."""
    if name is None:
        return None
    if "metrics" in record:
        value = record["metrics"].get(per_norm(statistic, name))
    else:
        value = ((record.get("norms") or {}).get(name) or {}).get(statistic)
    return None if value is None else float(value)


def share_baseline(record: dict) -> dict | None:
    """``{"median", "d": width, "k": dead dimension}`` of the random share baseline every norm shares, or
    None (not recorded, or the norms have their own)."""
    if "metrics" not in record:
        return record.get("share_baseline") or None
    median = record["metrics"].get(baseline_metric("median"))
    if median is None:
        return None
    info = next(iter((record.get("norm_info") or {}).values()), {})
    return {"median": median, "d": info.get("width"), "k": info.get("dead_dim")}
