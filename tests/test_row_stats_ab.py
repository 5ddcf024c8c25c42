"""The benchmarks that compare side by side (row_stats_ab, hook_split, hooks_ab, defer_ab, idle_step)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "row_stats_ab.py"


def test_it_compares_the_working_tree_with_a_revision_like_for_like(capsys):
    spec = importlib.util.spec_from_file_location("row_stats_ab", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--rev", "HEAD", "--widths", "32", "--pairs", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 32 | `histogram_rows` |" in out and "| 32 | `read` |" in out


def test_the_hook_split_reports_dispatch_and_arithmetic(capsys):
    path = BENCH.parent / "hook_split.py"
    spec = importlib.util.spec_from_file_location("hook_split", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--shapes", "16,1,2", "--pairs", "2"]) == 0
    assert "| 16 x 1, 2 |" in capsys.readouterr().out


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hooks_are_compared_with_a_revision_like_for_like(capsys):
    assert _bench("hooks_ab").main(["--rev", "HEAD", "--shapes", "16,1,2", "--pairs", "2"]) == 0
    assert "| 16 x 1, 2 |" in capsys.readouterr().out


def test_the_deferred_taps_leave_the_rows_the_hooks_leave(capsys):
    # the deferred tap's rows equal the hooks' to the bit and the batched one's to rounding, or main exits
    assert _bench("defer_ab").main(["--shapes", "16,1,2", "--pairs", "2"]) == 0
    assert "| 16 x 1, 2 |" in capsys.readouterr().out


def test_the_idle_step_is_timed_at_the_defaults_with_and_without_the_loss_and_with_findings_off(capsys):
    assert _bench("idle_step").main(["--shapes", "16,1,2", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "| 16 x 1, 2 |" in out and out.count("x) |") == 3  # the three doors timed


def test_a_shape_that_is_not_three_integers_is_refused_saying_why(capsys):
    for argv in (["--shapes", "64,2"], ["--shapes", "30,1,2"]):
        with pytest.raises(SystemExit) as exit_:
            _bench("defer_ab").main(argv)
        assert exit_.value.code == 2
    assert "is not width,depth,batch" in capsys.readouterr().err
