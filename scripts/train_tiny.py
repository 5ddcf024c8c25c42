"""Thin wrapper: ``python scripts/train_tiny.py ARGS`` is ``lnmonitor train-tiny ARGS``."""

import sys

from lnmonitor.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-tiny", *sys.argv[1:]]))
