"""The ``lnmonitor`` command line. Bad input exits with code 2 and one line on stderr."""

from __future__ import annotations

import argparse
import importlib
import sys

from lnmonitor.errors import UsageError

__all__ = ["COMMANDS", "build_parser", "main"]

# Each module under lnmonitor.commands registers one subcommand.
COMMANDS = ("train_tiny", "eps_compare", "report", "analyze", "summarize")


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="lnmonitor",
                            description="Watch what LayerNorm does to a transformer while it trains.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=_OneLineParser)
    for name in COMMANDS:
        importlib.import_module(f"lnmonitor.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0) or bad arguments (2, one line already printed)
        return int(done.code or 0)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"lnmonitor {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
