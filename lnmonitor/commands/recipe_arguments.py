"""The command-line options shared by the commands that train the tiny recipe (``train-tiny``,
``eps-compare``, ``--data`` for ``analyze``; research/stability's testbed too) and the :class:`Recipe` they
describe.  Imports no torch."""

from __future__ import annotations

import argparse

from lnmonitor.errors import UsageError
from lnmonitor.tiny.corpus import BUILT_IN
from lnmonitor.tiny.recipe import DECAYS, INITS, Recipe

__all__ = [
    "add_data_argument", "add_recipe_arguments", "add_shard_argument", "parse_shard", "recipe_from_args",
    "trainer_kwargs",
]


def add_data_argument(parser: argparse.ArgumentParser, purpose: str) -> None:
    """``--data``: a UTF-8 text file, or a built-in corpus by name (``./NAME`` reads a file of that name)."""
    names = " or ".join(BUILT_IN)
    parser.add_argument("--data", default=None, metavar="FILE_OR_CORPUS",
                        help=f"UTF-8 text file {purpose}, or a built-in corpus: {names} "
                        "(default: python-help, the Python help text shipped with CPython; "
                        "python-source is the standard library's own .py files)")


def add_shard_argument(parser: argparse.ArgumentParser, unit: str, merged: str) -> None:
    """``--shard I/N``: run every N-th ``unit`` from the I-th (read with :func:`parse_shard`)."""
    parser.add_argument("--shard", default=None, metavar="I/N",
                        help=f"run only every N-th {unit} starting at the I-th (I counts from 0), "
                        f"e.g. --shard $SLURM_ARRAY_TASK_ID/4; {merged}")


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) as ``(i, n)``; None is ``(0, 1)``, the whole grid."""
    if text is None:
        return (0, 1)
    parts = str(text).split("/")
    try:
        if len(parts) != 2:
            raise ValueError
        index, count = int(parts[0], 10), int(parts[1], 10)
    except ValueError:
        raise UsageError(f"--shard must look like i/n (e.g. 0/3), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"--shard i/n needs n >= 1 and 0 <= i < n (i counts from 0), got {text!r}")
    return (index, count)


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that trains the recipe (defaults: the study's recipe)."""
    defaults = Recipe()
    add_data_argument(parser, "to train on")
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
        norm=args.norm, max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr, init=args.init,
        decay=args.decay, width=args.width, depth=args.depth, heads=args.heads, context=args.context,
        val_every=min(args.val_every, args.max_steps) if args.max_steps > 0 else args.val_every,
        trainer_kwargs=trainer_kwargs(args),
    )
    fields.update(overrides)
    return Recipe(**fields)
