"""``lnmonitor report OUT``: rebuild an eps comparison's report without training."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "run"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="rebuild report.md and the figures of an eps-compare folder",
        description="Rebuild results.json, report.md and the PNG figures of an eps-compare --out "
        "folder from its run records and TensorBoard event files, without training. Records "
        "finished by other shards since the last report are merged in.",
    )
    parser.add_argument("out", type=Path, help="the --out folder of lnmonitor eps-compare")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lnmonitor.experiments.report import REPORT_NAME, rebuild

    results = rebuild(args.out)
    done, missing = len(results["runs"]), len(results["missing"])
    print(f"report: {args.out / REPORT_NAME} ({done} of {done + missing} runs finished)")
    for diff in results["differences"].values():
        print(f"report: {diff['verdict']}")
    return 0
