"""``lnmonitor analyze``: the structural probes on one checkpoint, as tables, JSON and figures."""

from __future__ import annotations

import argparse
from pathlib import Path

from lnmonitor.commands.recipe_arguments import add_data_argument
from lnmonitor.errors import UsageError

__all__ = ["register", "run"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze", help="run the structural probes on a train-tiny or eps-compare checkpoint",
        description="Reproduce the LayerNorm story on one checkpoint: each norm's Jacobian against "
        "autograd, block versus branch rank, dead-plane shares against the random baseline, the "
        "1/sigma ladder, final-norm invariance and the scale sweep. Prints the tables and writes "
        "analysis.md, analysis.json and PNG figures next to the checkpoint.",
    )
    parser.add_argument("checkpoint", type=Path, help="a .ckpt written by train-tiny or eps-compare")
    add_data_argument(parser, "to measure on (its last 10%% is the held-out part)")
    parser.add_argument("--batches", type=int, default=None,
                        help="held-out batches of 32 windows to measure shares and the ladder on "
                        "(default: all, up to 16)")
    parser.add_argument("--position", type=int, default=-1,
                        help="sequence position of the Jacobian probes (default: -1, the last)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="rank tolerance relative to the largest singular value "
                        "(default: numpy's rule, s_max * d * eps_float64)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for analysis.md, analysis.json and the figures "
                        "(default: the checkpoint's folder)")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lnmonitor.tiny.checkpoint import checkpoint_file, load_checkpoint
    from lnmonitor.tiny.corpus import corpus_name, load_corpus

    # what needs no torch is checked before torch, Lightning and scipy are imported (seconds)
    if args.rtol is not None and not 0.0 < args.rtol < 1.0:
        raise UsageError(f"--rtol must be in (0, 1), got {args.rtol}")
    if args.batches is not None and args.batches < 1:
        raise UsageError(f"--batches must be a positive integer, got {args.batches}")
    checkpoint_file(args.checkpoint)
    text = load_corpus(args.data)
    from lnmonitor.experiments.analysis import analyze
    from lnmonitor.experiments.analysis_report import to_terminal, write_outputs
    from lnmonitor.tiny.data import CharDataModule

    module, step = load_checkpoint(args.checkpoint)
    held_out = CharDataModule(text, vocab=module.vocab, context=module.config.context).val_batches()
    name = corpus_name(args.data)
    result = analyze(
        module, held_out, data_name=name, batches=args.batches, position=args.position, rtol=args.rtol,
        checkpoint=str(args.checkpoint), step=step,
    )
    folder = args.out if args.out is not None else args.checkpoint.resolve().parent
    written = write_outputs(result, folder, figures=not args.no_figures)
    print(to_terminal(result))
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    return 0
