"""docs/layout.md: the folders are floors, each importing only the ones below it."""

from __future__ import annotations

import re
from pathlib import Path

import lnmonitor

# bottom up; the doors stand side by side on one floor and import neither each other
FLOORS = [("core",), ("views",), ("lightning", "integrations"), ("tiny",), ("experiments",), ("commands",)]


def test_every_folder_imports_only_the_floors_below_it():
    root = Path(lnmonitor.__file__).parent
    below: set[str] = {"errors"}  # lnmonitor/errors.py: the exceptions every floor may raise
    wrong = []
    for floor in FLOORS:
        for folder in floor:
            for path in sorted((root / folder).rglob("*.py")):
                for name in re.findall(r"^\s*(?:from|import) lnmonitor\.(\w+)", path.read_text(), re.M):
                    if name != folder and name not in below:
                        wrong.append(f"{path.relative_to(root)} imports lnmonitor.{name}")
        below |= set(floor)
    assert not wrong, wrong
