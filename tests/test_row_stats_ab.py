"""benchmarks/row_stats_ab.py: a revision's row_stats against the working tree's, on one step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "row_stats_ab.py"


def test_it_compares_the_working_tree_with_a_revision_like_for_like(capsys):
    spec = importlib.util.spec_from_file_location("row_stats_ab", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--rev", "HEAD", "--widths", "32", "--pairs", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 32 | `histogram_rows` |" in out and "| 32 | `read` |" in out
