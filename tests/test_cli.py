"""The command line: help and the report load neither torch nor Lightning."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["--help"], ["train-tiny", "--help"], ["eps-compare", "--help"],
                                  ["report", "/nonexistent"]])
def test_help_and_report_import_neither_torch_nor_lightning(args):
    code = (
        "import sys\n"
        "from lnmonitor.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
