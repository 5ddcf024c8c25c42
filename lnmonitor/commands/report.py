"""``lnmonitor report OUT [OUT ...] [--law DIR]``: rebuild eps comparisons' reports without
training, and the law across them."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "run"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "report", help="rebuild report.md and the figures of eps-compare folders, and the law across them",
        description="Rebuild results.json, report.md and the PNG figures of each eps-compare --out "
        "folder from its run records, without training. Records finished by other shards since the "
        "last report are merged in. With --law, also fit one law across the folders: every run's "
        "validation loss minus its folder's smallest eps at the same seed, against the first norm's "
        "eps/var (at step 0, over training, at the end), with the rank correlation and a fitted "
        "curve with its bootstrap interval.",
    )
    parser.add_argument("out", type=Path, nargs="+", help="the --out folder(s) of lnmonitor eps-compare")
    parser.add_argument("--law", type=Path, metavar="DIR",
                        help="write the law across the folders to DIR: law.md, law.json, law.png")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lnmonitor.experiments.eps.report import REPORT_NAME, rebuild

    rebuilt = rebuild(args.out)
    for out, results in rebuilt.items():
        done, missing = len(results["runs"]), len(results["missing"])
        print(f"report: {Path(out) / REPORT_NAME} ({done} of {done + missing} runs finished)")
        for diff in results["differences"].values():
            print(f"report: {diff['verdict']}")
    if args.law is not None:
        from lnmonitor.experiments.eps.law import sentence, write_law

        result = write_law(args.law, rebuilt)
        best = result["best"]
        print(f"law: {args.law / 'law.md'} ({len(result['points'])} points from {len(rebuilt)} folders)")
        print(f"law: {sentence(result['fits'][best]) if best else 'no predictor has a fit'}")
    return 0
