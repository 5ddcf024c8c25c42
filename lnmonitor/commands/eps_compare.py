"""``lnmonitor eps-compare``: train the recipe at several eps and seeds, measure, report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lnmonitor.commands.recipe_arguments import (
    add_recipe_arguments,
    add_shard_argument,
    parse_shard,
    recipe_from_args,
)
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps.compare import DEFAULT_OUT, run_experiment
from lnmonitor.experiments.eps.grid import DEFAULT_EPS, DEFAULT_SEEDS, Experiment, parse_eps, parse_seeds
from lnmonitor.experiments.eps.run import RunInterrupted
from lnmonitor.tiny.corpus import corpus_name, load_corpus

__all__ = ["register", "run"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eps-compare", help="train the tiny GPT at several eps and seeds and report the difference",
        description="Train the tiny character GPT once per (eps, seed) with the monitors attached, "
        "measure each finished model on held-out text (validation loss, final-norm invariance, "
        "1/sigma ladder, dead-plane shares) and write results.json, report.md and figures to --out. "
        "Finished runs are skipped, interrupted ones resume from their last checkpoint.",
    )
    parser.add_argument("--eps", nargs="*", default=[f"{e:g}" for e in DEFAULT_EPS], metavar="EPS",
                        help=f"eps values to compare (default: {' '.join(f'{e:g}' for e in DEFAULT_EPS)})")
    parser.add_argument("--seeds", nargs="*", default=[str(s) for s in DEFAULT_SEEDS], metavar="SEED",
                        help=f"seeds per eps (default: {' '.join(map(str, DEFAULT_SEEDS))})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for runs, results.json, report.md and figures (default: %(default)s)")
    add_shard_argument(parser, "(eps, seed) pair", "the report merges whatever is finished")
    parser.add_argument("--force", action="store_true",
                        help="redo this invocation's runs from scratch even if they finished")
    parser.add_argument("--remeasure", action="store_true",
                        help="train nothing: measure this invocation's finished runs again from their "
                        "checkpoints (after an lnmonitor update) and rebuild the report")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained side by side, the torch threads split between them "
                        "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar during each fit")
    add_recipe_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Everything that can be wrong with the input is checked before --out is touched.
    eps = parse_eps(args.eps)
    seeds = parse_seeds(args.seeds)
    shard = parse_shard(args.shard)
    if args.jobs < 1:
        raise UsageError(f"--jobs must be a positive integer (runs side by side), got {args.jobs}")
    if args.remeasure and args.force:
        raise UsageError("--remeasure measures finished runs again, --force trains them again: choose one")
    if str(args.devices) == "auto":
        args.devices = "1"  # one process per run; a multi-GPU "auto" would start DDP
    elif str(args.devices) != "1":
        raise UsageError(f"eps-compare trains each run on one device, got --devices {args.devices}: to use "
                         "several devices, start one shard per device (e.g. CUDA_VISIBLE_DEVICES=i ... "
                         "--shard i/n)")
    recipe = recipe_from_args(args)
    text = load_corpus(args.data)
    from lnmonitor.tiny.data import CharDataModule  # torch and Lightning: after the checks that need neither

    CharDataModule(text, context=recipe.context)
    try:
        run_experiment(Experiment(recipe, eps, seeds), text, args.out, shard=shard, force=args.force,
                       monitor=not args.no_monitor, progress=not args.no_progress, jobs=args.jobs,
                       remeasure=args.remeasure, data_name=corpus_name(args.data))
    except RunInterrupted as err:
        print(f"lnmonitor eps-compare: {err}", file=sys.stderr)
        return 1
    return 0
