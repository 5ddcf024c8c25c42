"""``lnmonitor stability-grid``: the testbed of runs made to go wrong, and its table."""

from __future__ import annotations

import argparse
from pathlib import Path

from lnmonitor.commands.recipe_arguments import add_data_argument, add_shard_argument, parse_shard
from lnmonitor.errors import UsageError
from lnmonitor.tiny.corpus import load_corpus

__all__ = ["register", "run"]

DEFAULT_OUT = Path("runs/stability")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "stability-grid", help="train the testbed of runs made to go wrong and tabulate the signals",
        description="Train the tiny GPT in the configurations of the stability testbed (high lr with "
        "and without warm-up, large eps at both inits, weight decay off, QK-norm on, late output-logit "
        "divergence with z-loss as control), record every step's loss and every measured step's "
        "signals, then write table.md: each signal's and each peer rule's lead time before the "
        "events, hits and false alarms (docs/findings.md). Finished runs are skipped.",
    )
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
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise UsageError(f"--jobs must be a positive integer (runs side by side), got {args.jobs}")
    shard = parse_shard(args.shard)
    from lnmonitor.experiments.stability.table import write_table

    if not args.table_only:
        from lnmonitor.experiments.stability.testbed import run_testbed

        run_testbed(load_corpus(args.data), args.out, names=args.configs, jobs=args.jobs, force=args.force,
                    shard=shard)
    path = write_table(args.out, args.doc)
    print(f"stability-grid: table {path}")
    return 0
