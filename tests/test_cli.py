"""The command line: help, the report and one-line errors about paths and arguments load
neither torch, Lightning nor scipy (seconds of imports before a one-line answer)."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "lightning", "scipy")


@pytest.mark.parametrize("args, code", [
    (["--help"], 0), (["train-tiny", "--help"], 0), (["eps-compare", "--help"], 0),
    (["analyze", "--help"], 0),
    (["report", "/nonexistent"], 2),
    (["train-tiny", "--data", "missing.txt"], 2), (["train-tiny", "--eps", "0"], 2),
    (["eps-compare", "--data", "missing.txt"], 2),
    (["analyze", "notes.md"], 2), (["analyze", "missing.ckpt"], 2),
    (["analyze", "notes.md", "--rtol", "2"], 2), (["summarize", "missing"], 2),
    # the research's commands are not the installed CLI's (python -m research.stability, research.eps)
    (["stability-grid", "--table-only"], 2), (["report", "notes.md", "--law", "law"], 2),
])
def test_help_and_one_line_errors_import_neither_torch_lightning_nor_scipy(args, code, tmp_path):
    (tmp_path / "notes.md").write_text("# notes\n\nnot a checkpoint\n")
    program = (
        "import sys\n"
        "from lnmonitor.commands.cli import main\n"
        f"try:\n    code = main({args!r})\nexcept SystemExit as done:\n    code = done.code\n"
        f"print(code, sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.stdout.strip().splitlines()[-1] == f"{code} []", out.stdout + out.stderr
    if code == 2:
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "runs").exists()
