"""benchmarks/small_models.py runs end to end, for three steps: the plain-loop monitor on nanoGPT's
smallest shape and the tiny model at widths 64 and 128, every step, at its defaults (with the loss
handed, and with findings off) and against a plain loop."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their shared stepping module
spec = importlib.util.spec_from_file_location("small_models", BENCHMARKS / "small_models.py")
small_models = importlib.util.module_from_spec(spec)
sys.modules["small_models"] = small_models  # its dataclasses look their module up
spec.loader.exec_module(small_models)


def test_the_small_models_run_for_three_steps_and_fill_their_table(tmp_path, capsys):
    out = tmp_path / "small.json"
    assert small_models.main(["--steps", "3", "--warmup", "1", "--no-memory", "--import-runs", "1",
                              "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 64 x 2, 12 |" in table and "| 64 x 4, 32 |" in table and "| 128 x 4, 32 |" in table
    assert "findings off" in table and "defaults, add_loss" in table
    rows = json.loads(out.read_text())
    assert [(r["width"], r["depth"], r["batch"]) for r in rows] == [(64, 2, 12), (64, 4, 32), (128, 4, 32)]
    assert all(r["plain_ms"] > 0 and math.isfinite(r["measured_ms"]) and math.isnan(r["plain_peak_mb"])
               for r in rows)
    # steps 1 and 2: no default monitor measures, each timed against the plain step of its turn
    assert all(set(r["idle_us"]) == {"defaults", "add_loss", "findings off"} for r in rows)
    assert all(math.isfinite(us) for r in rows for us in r["idle_us"].values())

