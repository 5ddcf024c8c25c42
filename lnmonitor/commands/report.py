"""``lnmonitor report OUT [OUT ...]``: rebuild eps comparisons' reports without training."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "run"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="rebuild report.md and the figures of eps-compare folders",
        description="Rebuild results.json, report.md and the PNG figures of each eps-compare --out "
        "folder from its run records, without training. Records finished by other shards since the "
        "last report are merged in.",
    )
    parser.add_argument("out", type=Path, nargs="+", help="the --out folder(s) of lnmonitor eps-compare")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lnmonitor.experiments.eps.report import REPORT_NAME, rebuild

    for out, results in rebuild(args.out).items():
        done, missing = len(results["runs"]), len(results["missing"])
        print(f"report: {Path(out) / REPORT_NAME} ({done} of {done + missing} runs finished)")
        for diff in results["differences"].values():
            print(f"report: {diff['verdict']}")
    return 0
