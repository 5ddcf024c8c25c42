"""Thin wrapper: ``python scripts/eps_comparison.py ARGS`` is ``lnmonitor eps-compare ARGS``."""

import sys

from lnmonitor.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["eps-compare", *sys.argv[1:]]))
