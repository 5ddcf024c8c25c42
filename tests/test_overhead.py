"""benchmarks/overhead.py's small rows (``--small``) run end to end, for three steps: the table of
nanoGPT's smallest shape and the tiny model at widths 64 and 128, each against a plain loop."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"
spec = importlib.util.spec_from_file_location("overhead", SCRIPT)
overhead = importlib.util.module_from_spec(spec)
sys.modules["overhead"] = overhead  # its dataclasses look their module up
spec.loader.exec_module(overhead)


def test_the_small_rows_run_for_three_steps_and_fill_their_table(tmp_path, capsys):
    out = tmp_path / "small.json"
    assert overhead.main(["--widths", "--small", "--steps", "3", "--warmup", "1", "--no-memory",
                          "--import-runs", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "nanoGPT's smallest" in table and "tiny, width 64" in table and "tiny, width 128" in table
    rows = json.loads(out.read_text())["small"]
    assert [(r["width"], r["depth"], r["batch"], r["context"]) for r in rows] == [
        (64, 2, 12, 64), (64, 4, 32, 64), (128, 4, 32, 64)]
    assert all(r["plain_ms"] > 0 and r["every_ms"] > 0 and math.isnan(r["plain_peak_mb"]) for r in rows)
    assert all(r["defaults_idle_ms"] > 0 and r["quiet_idle_ms"] > 0 for r in rows)  # step 1: neither measures
    assert "defaults, findings off" in table
