"""research.eps.delay: the eps 0.1 cost as steps lost, exact on synthetic curves and
as docs/eps.md tabulates it from the committed records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from research.eps import RECORDS, RESULTS
from research.eps import delay as eps_delay

# eps 1e-5 falls 1 nat per 100 steps from 5 at step 0; eps 0.1 is the same curve 50 steps later
SMALL = [(0, 5.0), (100, 4.0), (200, 3.0), (300, 2.0), (400, 1.0)]
LARGE = [(0, 5.5), (100, 4.5), (200, 3.5), (300, 2.5), (400, 1.5)]


def test_at_interpolates_linearly_and_refuses_outside_the_curve():
    assert eps_delay.at(SMALL, 250) == pytest.approx(2.5)
    assert eps_delay.at(SMALL, 400) == 1.0
    with pytest.raises(ValueError, match="outside"):
        eps_delay.at(SMALL, 401)


def test_reach_is_the_first_crossing_interpolated():
    assert eps_delay.reach(SMALL, 2.5) == pytest.approx(250)
    assert eps_delay.reach(SMALL, 6.0) == 0.0
    assert eps_delay.reach(SMALL, 0.5) is None
    # the first time, not the last: a curve that dips below and comes back
    assert eps_delay.reach([(0, 3.0), (100, 1.0), (200, 2.0), (300, 0.5)], 1.5) == pytest.approx(75)


def test_a_shifted_curve_is_delayed_by_its_shift_at_every_budget():
    for budget in (100, 250, 400):
        assert eps_delay.delay(SMALL, LARGE, budget) == pytest.approx(50)
        assert eps_delay.signed_delay(SMALL, LARGE, budget) == pytest.approx(50)


def test_the_delay_only_looks_at_the_eps_1e5_run_up_to_the_budget():
    # eps 1e-5 gets as low as eps 0.1's loss at step 100 only at step 150: never by step 100
    small = [(0, 5.0), (100, 5.0), (200, 3.0)]
    large = [(0, 6.0), (100, 4.0), (200, 3.5)]
    assert eps_delay.delay(small, large, 100) is None
    assert eps_delay.signed_delay(small, large, 100) < 0  # eps 0.1 is ahead there
    assert eps_delay.delay(small, large, 200) == pytest.approx(25)  # 3.5 at step 175


def test_eps_01_ahead_gives_a_negative_delay_and_level_runs_none():
    assert eps_delay.signed_delay(LARGE, SMALL, 300) == pytest.approx(-50)
    assert eps_delay.signed_delay(SMALL, SMALL, 300) == 0.0


def _folder(tmp_path: Path, small, large) -> Path:
    """An eps-compare output folder with one seed: ``small`` at eps 1e-5, ``large`` at 0.1, as
    validation and training curves, their steps logged as step indices (99 after 100 steps)."""
    for eps, curve in (("1e-05", small), ("0.1", large)):
        run = tmp_path / f"eps={eps}" / "seed=0"
        run.mkdir(parents=True)
        logged = [[s - 1, v] for s, v in curve if s]
        (run / "result.json").write_text(json.dumps(
            {"seed": 0, "finished": True, "curves": {"val/loss": logged, "train/loss": logged}}))
    return tmp_path


def test_the_share_is_of_the_budget_in_steps_taken(tmp_path):
    (row,) = eps_delay.rows({"x": _folder(tmp_path, SMALL, LARGE)}, budgets=(399,))
    assert row["budget"] == 400 and row["seeds"] == [0]
    assert row["delays"] == [pytest.approx(50)]
    assert row["shares"] == [pytest.approx(50 / 400)]
    assert row["gaps"] == [pytest.approx(0.5)]
    assert row["train_delays"] == []  # four logged points: none smoothed over five


def test_smooth_is_a_trailing_mean():
    assert eps_delay.smooth([(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)], 2) == [(1, 1.5), (2, 2.5), (3, 3.5)]


def test_budgets_beyond_a_run_are_left_out(tmp_path):
    assert set(eps_delay.delays(_folder(tmp_path, SMALL, LARGE), budgets=(199, 399, 999))) == {199, 399}


def test_main_prints_the_table(tmp_path, capsys):
    assert eps_delay.main(["--folder", str(_folder(tmp_path, SMALL, LARGE)), "--budgets", "199"]) == 0
    row = "| 200 | 50 (50 to 50) | 0.25 (0.25 to 0.25) | - | +0.500 (+0.500 to +0.500) |"
    assert row in capsys.readouterr().out


# the committed records (docs/eps.md, "The cost as steps lost")


def _records(path: Path) -> Path:
    if not list(path.glob("eps=0.1/seed=*/result.json")):
        pytest.skip(f"{path} is not in this checkout")
    return path


def test_the_help_text_delay_grows_with_the_budget_while_the_gap_shrinks():
    by_budget = eps_delay.delays(_records(RESULTS / "eps-compare-gpt2-init"))
    assert sorted(by_budget) == [999, 1999, 2999]
    delays = {b: sorted(d for d, _ in seeds.values()) for b, seeds in by_budget.items()}
    gaps = {b: [g for _, g in seeds.values()] for b, seeds in by_budget.items()}
    assert [len(d) for d in delays.values()] == [8, 8, 8]
    assert delays[999][0] == pytest.approx(278, abs=1) and delays[999][-1] == pytest.approx(416, abs=1)
    assert delays[2999][0] == pytest.approx(558, abs=1) and delays[2999][-1] == pytest.approx(1044, abs=1)
    assert min(gaps[999]) > max(gaps[2999]) > 0


def test_the_source_loses_a_larger_share_than_the_help_text():
    source = eps_delay.delays(_records(RECORDS / "law-oos/python-source-4x128"))
    per_seed = sorted(round(d) for d, _ in source[2999].values())
    assert per_seed == [1032, 1137, 1281]
    assert all(g > 0.12 for _, g in source[2999].values())


def test_the_default_init_control_is_level_within_a_few_hundredths():
    control = eps_delay.delays(_records(RESULTS / "eps-compare"))
    assert all(abs(g) < 0.02 for seeds in control.values() for _, g in seeds.values())


def test_the_table_has_a_row_per_set_and_budget():
    _records(RESULTS / "eps-compare-gpt2-init")
    table = eps_delay.markdown({"help": RESULTS / "eps-compare-gpt2-init"})
    assert table.count("\n| help |") == 3
    assert "| help | 8 | 1,000 | 335 (278 to 416) | 0.34 (0.28 to 0.42) |" in table


def test_the_control_is_printed_without_a_minus_zero():
    _records(RESULTS / "eps-compare")
    table = eps_delay.markdown({"control": RESULTS / "eps-compare"})
    assert "| control | 8 | 2,000 | 0 (-306 to 118) | 0.00 (-0.15 to 0.06) |" in table
    assert "| -0 " not in table and "| -0.00 " not in table
