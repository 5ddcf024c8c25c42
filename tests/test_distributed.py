"""Both monitors under real 2-process DDP and FSDP2 (gloo on CPU), with blocks as FSDP units and
with every norm a unit of its own: the same statistics and roles as one process on the same
global batch, one all_gather per logging step, and the invariance probe run by every rank of a
sharded model (its forward is a collective)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    free_port,
)

from lnmonitor.core.summaries import SHARE_RESOLUTION, SIGMA_RESOLUTION, VAR_RESOLUTION

SCRIPT = Path(__file__).with_name("distributed_monitor_script.py")


def run(strategy: str, devices: int, out: Path, accelerator: str = "cpu", model: str = "tiny") -> dict:
    """Run tests/distributed_monitor_script.py in fresh processes; its JSON."""
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, str(devices), str(out), accelerator, model], env=env,
        cwd=SCRIPT.parent.parent,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run("ddp", 1, tmp_path_factory.mktemp("single") / "out.json")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2-norms"])
def test_two_processes_match_one(single, tmp_path, strategy):
    two = run(strategy, 2, tmp_path / "out.json")
    assert two["world"] == 2 and single["world"] == 1
    assert two["collectives"] == 2  # one all_gather per logging step (two steps)
    assert two["rows"] == single["rows"] == [8 * 16] * 5  # every row of the global batch
    assert [h["step"] for h in two["history"]] == [h["step"] for h in single["history"]] == [0, 1]
    for a, b in zip(two["history"], single["history"], strict=True):
        assert a.keys() == b.keys()
        for key, va in a.items():
            vb = b[key]
            kind = key.split("/")[1] if "/" in key else key
            if kind in ("share_median", "share_p90"):
                assert abs(va - vb) <= SHARE_RESOLUTION, key
            elif kind in ("sigma", "inv_sigma", "rms"):
                assert va == pytest.approx(vb, rel=SIGMA_RESOLUTION), key
            elif kind in ("eps_over_var", "transmission", "ladder"):
                assert va == pytest.approx(vb, rel=2 * VAR_RESOLUTION), key
            elif kind == "share_max":
                assert va == pytest.approx(vb, abs=1e-5), key
            else:  # step, skipped rows, baselines
                assert va == pytest.approx(vb, rel=1e-9), key
    # the invariance monitor: on, every point, the values of one process (before any update
    # exactly the same model and probe rows)
    assert two["disabled"] is None and single["disabled"] is None
    assert [h["step"] for h in two["invariance"]] == [h["step"] for h in single["invariance"]] == [0, 1, 2]
    first, ref = two["invariance"][0], single["invariance"][0]
    assert first.keys() == ref.keys()
    for key, value in first.items():
        assert value == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_tensor_parallel_trains_on_and_both_monitors_say_why_they_measure_nothing(tmp_path):
    # ModelParallelStrategy(tensor_parallel_size=2), every norm SequenceParallel: a norm's input
    # and its gradient are DTensors sharded along the sequence, which the taps do not reduce
    # (their per-row reductions need the local rows: x.to_local(), grad.to_local()). Gloo runs
    # the all_gather and reduce_scatter of sequence parallelism on CPU, so this is the model's
    # real run; the check of every norm passes (its own forward on gathered weights), the
    # invariance probe runs on every rank (a tensor-parallel forward is a collective), and
    # training goes on with both monitors off, each saying why, instead of an abort.
    tp = run("tp", 2, tmp_path / "out.json")
    assert tp["world"] == 2 and tp["steps"] == 2
    assert tp["history"] == [] and tp["rows"] == []
    assert "inside a norm's hook" in tp["off"] and "DTensor" in tp["off"]
    assert "DTensor" in tp["disabled"]

