"""``lnmonitor train-tiny``: train the tiny character GPT with the monitors attached."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from lnmonitor.tiny.corpus import DEFAULT_CORPUS_NAME, load_corpus
from lnmonitor.tiny.recipe import DECAYS, INITS, Recipe

# the dashboard with lnmonitor's charts, at TensorBoard's default port
CUSTOM_SCALARS = "http://localhost:6006/#custom_scalars"


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that trains the recipe (defaults: the study's recipe)."""
    defaults = Recipe()
    parser.add_argument("--data", type=Path, default=None,
                        help=f"UTF-8 text file to train on (default: {DEFAULT_CORPUS_NAME})")
    parser.add_argument("--norm", choices=("layer", "rms"), default=defaults.norm,
                        help="normalisation layer: LayerNorm or RMSNorm (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps,
                        help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="sequences per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=defaults.lr,
                        help="peak of the one-cycle learning rate (default: %(default)s)")
    parser.add_argument("--init", choices=INITS, default=defaults.init,
                        help="initialisation: PyTorch's own, as the study, or GPT-2's N(0, 0.02) "
                        "(default: %(default)s)")
    parser.add_argument("--decay", choices=DECAYS, default=defaults.decay,
                        help="weight decay 0.1 on every parameter, as the study's AdamW, or on the "
                        "matrices only (default: %(default)s)")
    for name in ("width", "depth", "heads", "context"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name),
                            help=f"model {name} (default: %(default)s)")
    parser.add_argument("--val-every", type=int, default=defaults.val_every,
                        help="validate and checkpoint every N steps (default: %(default)s)")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator (default: auto)")
    parser.add_argument("--devices", default="auto", help="Lightning devices (default: auto)")
    parser.add_argument("--precision", default=None,
                        help="Lightning precision, e.g. bf16-mixed (default: 32-true)")
    parser.add_argument("--no-monitor", action="store_true",
                        help="train without the lnmonitor callbacks")


def trainer_kwargs(args: argparse.Namespace) -> dict:
    devices = int(args.devices) if str(args.devices).isdigit() else args.devices
    kwargs = {"accelerator": args.accelerator, "devices": devices}
    if args.precision is not None:
        kwargs["precision"] = args.precision
    return kwargs


def recipe_from_args(args: argparse.Namespace, **overrides) -> Recipe:
    fields = dict(
        norm=args.norm, max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
        init=args.init, decay=args.decay,
        width=args.width, depth=args.depth, heads=args.heads, context=args.context,
        val_every=min(args.val_every, args.max_steps) if args.max_steps > 0 else args.val_every,
        trainer_kwargs=trainer_kwargs(args),
    )
    fields.update(overrides)
    return Recipe(**fields)


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
