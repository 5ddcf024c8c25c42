"""benchmarks/fit_start.py's quick mode runs end to end: a transformers Llama of 161 norms (80 layers),
its discovery and float64 check, the first and a later measured step, and the monitors' fit start."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_start.py"


def _bench():
    spec = importlib.util.spec_from_file_location("fit_start", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fit_start"] = module
    spec.loader.exec_module(module)
    return module


def test_the_quick_mode_times_every_part_of_a_fit_start_on_161_norms(tmp_path, capsys):
    import torch

    from lnmonitor.core.meter import meter

    out, threads, choose = tmp_path / "fit_start.json", torch.get_num_threads(), meter.choose_norms
    assert _bench().main(["--quick", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads and meter.choose_norms is choose  # nothing left patched
    table = capsys.readouterr().out
    assert "| ms | 80 layers, 161 norms: median (min) |" in table
    assert "(a) of which discovery + float64 check" in table and "`LayerNormMonitor` setup" in table
    figures = json.loads(out.read_text())["80"]
    assert figures["norms"] == 161
    for key in ("plain", "ctor", "discovery", "first_result", "roles", "loop_ctor", "lightning_fit_start"):
        assert figures[key]["median"] > 0, key
    assert figures["discovery"]["median"] <= figures["ctor"]["median"]
    # the budget is a second; a walk quadratic in the norms would take many times that
    assert figures["ctor"]["median"] < 5 and figures["roles"]["median"] < 5


def test_nonsense_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench().main(["--repeats", "0"])
    assert exit_.value.code == 2
    assert "must be positive" in capsys.readouterr().err
