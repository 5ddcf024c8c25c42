"""Both monitors under real 2-process DDP and FSDP2 (gloo on CPU), with blocks as FSDP units and
with every norm a unit of its own, and under tensor parallelism (sequence-parallel norms,
replicated norms, a 2-D FSDP2 x TP mesh on 4 processes; Lightning's ModelParallelStrategy and a
plain loop with parallelize_module): the same statistics and roles as one process on the same
global batch, one merge over processes per logging step, and the invariance probe run by every rank of a
sharded model (its forward is a collective)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    free_port,
)

from lnmonitor.core.meter.row_stats import SHARE_RESOLUTION, SIGMA_RESOLUTION, VAR_RESOLUTION

SCRIPT = Path(__file__).with_name("distributed_monitor_script.py")
LOOP_SCRIPT = Path(__file__).with_name("tp_loop_script.py")


def run(strategy: str, devices: int, out: Path, accelerator: str = "cpu", model: str = "tiny") -> dict:
    """Run tests/distributed_monitor_script.py in fresh processes; its JSON."""
    return _script([SCRIPT, strategy, devices, out, accelerator, model], out)


def _script(args: list, out: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), str(SCRIPT.parent),
                                         os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, *map(str, args)], env=env, cwd=SCRIPT.parent.parent,
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
    assert_matches_one_process(two, single)
    # before any update exactly the same model and probe rows
    for key, value in two["invariance"][0].items():
        assert value == pytest.approx(single["invariance"][0][key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "devices"), [("tp", 2), ("tp-replicated", 2), ("fsdp2-tp", 4)])
def test_tensor_parallel_meshes_match_one_process(single, tmp_path, strategy, devices):
    # ModelParallelStrategy: tp is torchtitan's plan shape with every norm SequenceParallel (a
    # norm's input, output and gradient are DTensors sharded along the sequence: each rank's
    # local rows are its own, merged over the mesh); tp-replicated has no sequence parallelism
    # (every norm reads the same rows on both ranks: counted once, not twice); fsdp2-tp is a
    # 2-D mesh, FSDP2 over two data-parallel ranks of tensor-parallel pairs.  The roles, every
    # statistic and the invariance probe (run on every rank, the final norm's input whole) are
    # those of one process on the same global batch; a split matmul rounds differently, so the
    # probe's delta-losses agree to float32's resolution of the loss.
    tp = run(strategy, devices, tmp_path / "out.json")
    assert tp["world"] == devices and tp["steps"] == 2
    assert tp["off"] is None and tp["disabled"] is None
    assert_matches_one_process(tp, single)
    assert_probe_matches(tp["invariance"][0], single["invariance"][0])


@pytest.mark.slow
def test_plain_loop_with_parallelize_module_matches_one_process(tmp_path):
    # LoopMonitor on a model laid out by parallelize_module (every norm SequenceParallel, the
    # head's logits sharded over the vocabulary with loss_parallel), each rank running the global
    # batch: the rows and figures of one process, and the monitor's invariance probe, run on every
    # rank after the updates, gives one process's numbers to float32 noise
    single = _script([LOOP_SCRIPT, 1, tmp_path / "one.json"], tmp_path / "one.json")
    tp = _script([LOOP_SCRIPT, 2, tmp_path / "two.json"], tmp_path / "two.json")
    assert tp["off"] is None and single["off"] is None
    assert tp["disabled"] is None and single["disabled"] is None
    assert tp["rows"] == single["rows"] == [8 * 16] * 5

    def split(history):  # the ladder's dicts, and the probe's (at each step, and with the sweep at the end)
        probe = [h for h in history if any("/invariance/" in key for key in h)]
        return [h for h in history if h not in probe], probe

    (ladder, probe), (ladder_one, probe_one) = split(tp["history"]), split(single["history"])
    assert_history_matches(ladder, ladder_one)
    assert [h["step"] for h in probe] == [h["step"] for h in probe_one] == [0, 1, 1]
    for a, b in zip(probe, probe_one, strict=True):
        assert_probe_matches(a, b)
    assert_probe_matches(tp["invariance"], single["invariance"])


def assert_matches_one_process(many: dict, single: dict) -> None:
    """Every row of the global batch counted once, one merge per logging step, and every
    logged figure of ``single`` within one histogram bin; the invariance monitor on at every point."""
    assert many["merges"] == 2  # one merge over processes per logging step (two steps)
    assert many["rows"] == single["rows"] == [8 * 16] * 5  # every row of the global batch, once
    assert_history_matches(many["history"], single["history"])
    assert many["disabled"] is None and single["disabled"] is None
    assert [h["step"] for h in many["invariance"]] == [h["step"] for h in single["invariance"]] == [0, 1, 2]
    assert many["invariance"][0].keys() == single["invariance"][0].keys()


def assert_probe_matches(many: dict, single: dict) -> None:
    """The probe's figures of ``single``: the same names, the delta-losses to float32's resolution
    of the loss (a split matmul rounds differently), the float64 norm-output residuals alike, and
    the sweep's fit on those float32 delta-losses to 0.5%.  A delta-loss that rounds to exactly 0
    has no finite log10 (absent, or nan in a history): its |dloss| counts as 0 there."""
    logs = {k for k in many.keys() ^ single.keys() if k.endswith("log10_abs_dloss")}
    assert many.keys() - logs == single.keys() - logs, set(many) ^ set(single)
    for key in many.keys() | single.keys():
        value, ref = many.get(key, math.nan), single.get(key, math.nan)
        if key.endswith("log10_abs_dloss"):  # |dloss| itself, not its log: one ulp of the loss is 0.3 in it
            value, ref = (10.0**v if math.isfinite(v) else 0.0 for v in (value, ref))
        fit = key.endswith(("scale_slope", "scale_constant"))
        tolerance = dict(rel=5e-3) if fit else dict(rel=1e-4, abs=1e-6)
        assert value == pytest.approx(ref, nan_ok=True, **tolerance), key


def assert_history_matches(many: list[dict], single: list[dict]) -> None:
    """The same steps and names, every figure within one histogram bin."""
    assert [h["step"] for h in many] == [h["step"] for h in single] == [0, 1]
    for a, b in zip(many, single, strict=True):
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
