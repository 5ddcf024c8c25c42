"""``lnmonitor train-tiny``: train the tiny character GPT with the monitors attached."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from lnmonitor.commands.recipe_arguments import add_recipe_arguments, recipe_from_args
from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.recipe import Recipe

__all__ = ["CUSTOM_SCALARS", "register", "run"]

# the dashboard with lnmonitor's charts, at TensorBoard's default port
CUSTOM_SCALARS = "http://localhost:6006/#custom_scalars"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-tiny", help="train the tiny character GPT with the monitors attached",
        description="Train the tiny character-level GPT of the study lnmonitor grew out of (4 blocks, "
        "width 128, 3,000 steps) and log the lnmonitor curves to TensorBoard.",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--eps", type=float, default=Recipe().eps,
                        help="eps of every norm (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    parser.add_argument("--out", type=Path, default=Path("runs"),
                        help="folder for TensorBoard runs and checkpoints (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Everything that can be wrong with the input is checked before --out is touched, and
    # what needs no torch before torch and Lightning are imported (that takes seconds).
    recipe = recipe_from_args(args, eps=args.eps, seed=args.seed)
    text = load_corpus(args.data)
    from lightning.pytorch.loggers import TensorBoardLogger

    from lnmonitor.tiny.data import CharDataModule
    from lnmonitor.tiny.train import fit, monitor_callbacks

    CharDataModule(text, context=recipe.context)
    logger = TensorBoardLogger(save_dir=str(args.out), name="train-tiny", default_hp_metric=False)
    callbacks = [] if args.no_monitor else monitor_callbacks()
    result = fit(recipe, text, Path(logger.log_dir), logger=logger, callbacks=callbacks)
    vocab = len(set(text))
    periodic = result.steps - result.steps % recipe.val_every
    earlier = (f"; the val/loss shown during training is the validation at step {periodic}"
               if periodic != result.steps else "")
    print(
        f"\nfinal validation loss: {result.val_loss:.4f} nats/char at step {result.steps} "
        f"(uniform guess ln {vocab} = {math.log(vocab):.3f}{earlier})\n"
        f"TensorBoard logs: {result.log_dir}\n"
        f"checkpoint:       {result.checkpoint}\n"
        f"open with:        tensorboard --logdir {args.out}, then {CUSTOM_SCALARS} for the lnmonitor "
        "charts (TensorBoard itself opens on Time Series)"
    )
    return 0
