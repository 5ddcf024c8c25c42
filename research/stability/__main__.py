"""``python -m research.stability``: the testbed of runs made to go wrong, and its table.

Train the tiny GPT in the configurations of the stability testbed (high lr with and without
warm-up, large eps at both inits, weight decay off, QK-norm on, late output-logit divergence with
z-loss as control), record every step's loss and every measured step's signals, then write
table.md: each signal's and each peer rule's lead time before the events, hits and false alarms
(docs/findings.md).  Finished runs are skipped."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lnmonitor.commands.recipe_arguments import add_data_argument, add_shard_argument, parse_shard
from lnmonitor.errors import UsageError
from lnmonitor.tiny.corpus import load_corpus
from research.stability.table import write_table
from research.stability.testbed import DEFAULT_OUT, run_testbed

__all__ = ["main"]

PROG = "python -m research.stability"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for the run records and table.md (default: %(default)s)")
    parser.add_argument("--configs", nargs="*", default=None, metavar="NAME",
                        help="configurations to run (default: all of them)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs side by side, one torch thread each (default: %(default)s)")
    add_shard_argument(parser, "run (seed 0 of every configuration first)",
                       "the table merges whatever is finished")
    parser.add_argument("--force", action="store_true", help="train this invocation's runs again")
    parser.add_argument("--table-only", action="store_true",
                        help="train nothing: rebuild table.md from the records in --out")
    parser.add_argument("--doc", type=Path, default=None,
                        help="also put the table into this markdown file, between its "
                        "<!-- stability-table:start --> and <!-- stability-table:end --> markers")
    add_data_argument(parser, "to train on")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the testbed (or only rebuild its table); 0, or 2 after one line on stderr for a
    :class:`UsageError` (an unknown configuration, a bad shard, no records)."""
    args = build_parser().parse_args(argv)
    try:
        if args.jobs < 1:
            raise UsageError(f"--jobs must be a positive integer (runs side by side), got {args.jobs}")
        shard = parse_shard(args.shard)
        if not args.table_only:
            run_testbed(load_corpus(args.data), args.out, names=args.configs, jobs=args.jobs,
                        force=args.force, shard=shard)
        path = write_table(args.out, args.doc)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"{PROG}: table {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
