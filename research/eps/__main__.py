"""``python -m research.eps OUT [OUT ...] --out DIR``: rebuild the reports of eps-compare folders
(as ``lnmonitor report`` does) and fit one law across them into DIR: every run's validation loss
minus its folder's smallest eps at the same seed, against the first norm's eps/var (at step 0,
over training, at the end), with the rank correlation and a fitted curve with its bootstrap
interval (law.md, law.json, law.png)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps.report import REPORT_NAME, rebuild
from research.eps.law import sentence, write_law

__all__ = ["main"]

PROG = "python -m research.eps"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split(": ", 1)[1])
    parser.add_argument("folders", type=Path, nargs="+", metavar="OUT",
                        help="the --out folder(s) of lnmonitor eps-compare")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="where to write law.md, law.json and law.png")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Rebuild the folders' reports and write the law; 0, or 2 after one line on stderr for a
    :class:`UsageError` (a folder that is not an eps-compare one, too few points)."""
    args = build_parser().parse_args(argv)
    try:
        rebuilt = rebuild(args.folders)
        result = write_law(args.out, rebuilt)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    for folder in rebuilt:
        print(f"{PROG}: rebuilt {Path(folder) / REPORT_NAME}")
    best = result["best"]
    print(f"{PROG}: {args.out / 'law.md'} ({len(result['points'])} points from {len(rebuilt)} folders)")
    print(f"{PROG}: {sentence(result['fits'][best]) if best else 'no predictor has a fit'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
