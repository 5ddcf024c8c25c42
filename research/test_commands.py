"""The research commands docs/*.md and research/README.md give parse as written (nothing is run),
as tests/test_readme.py checks the ``lnmonitor`` ones."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from research.eps.__main__ import build_parser as eps_parser
from research.stability.__main__ import build_parser as stability_parser

ROOT = Path(__file__).resolve().parents[1]
PARSERS = {"research.stability": stability_parser, "research.eps": eps_parser}
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "research" / "README.md"]
TEXT = "".join(p.read_text() for p in DOCS)
COMMANDS = sorted({line.split("#")[0].strip()
                   for line in re.findall(r"^python -m research\.(?:stability|eps) .*$", TEXT, re.M)})


def test_the_docs_give_both_commands():
    assert {shlex.split(c)[2] for c in COMMANDS} == set(PARSERS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_research_command_in_the_docs_parses(command):
    _, _, module, *args = shlex.split(command)
    PARSERS[module]().parse_args(args)
