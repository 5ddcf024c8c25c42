"""DeepSpeed ZeRO stage 2 and 3 on two CPU processes (gloo, under torchrun) through the three
integrations: the plain loop around ``deepspeed.initialize``'s engine, a ``transformers.Trainer``
with ``TrainingArguments(deepspeed=...)`` and Lightning's ``DeepSpeedStrategy``, against the same
run under DDP (or one process on the same global batch).

ZeRO-3 leaves a partitioned parameter's data an empty tensor outside its module's forward; with
``stage3_param_persistence_threshold`` 0 the norms' weights are partitioned too, and lnmonitor
gathers them (a collective every rank joins) for the float64 check that finds the norms and wherever
it reads a gain outside a forward. A ZeRO-3 model's forward is a collective, so the loop's monitor
and the Lightning callbacks probe it on every rank; the Trainer callback, which probes on the main
process, refuses it saying why.
"""

from __future__ import annotations

import importlib.util
import os
from unittest import mock

import pytest
from conftest import run_script
from test_distributed import (
    assert_history_matches,
    assert_matches_one_process,
    assert_probe_matches,
    single,  # noqa: F401 - the fixture of one process, for the Lightning callback
)
from test_distributed import run as lightning_run
from test_three_callbacks import _tolerance

from lnmonitor.core.invariance.runs import SHARDED_REFUSED

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (pip install -e '.[dev]')")

NORMS = ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "lnf"]


def deepspeed_run(tmp_path, integration: str, mode: str) -> dict:
    """tests/deepspeed_script.py on two processes under torchrun: rank zero's JSON."""
    return run_script("deepspeed_script.py", tmp_path / f"{integration}-{mode}.json", 2, integration, mode)


def split(history: list[dict]) -> tuple[list[dict], list[dict]]:
    """A monitor's history as the ladder's dicts and the invariance probe's."""
    probe = [h for h in history if any("/invariance/" in key for key in h)]
    return [h for h in history if h not in probe], probe


def test_zero3_partitioned_norms_are_found_gathered_and_measured(tmp_path):
    # stage3_param_persistence_threshold 0: every norm's weight and bias an empty tensor on each rank
    # when the monitor is built (before: "found no normalisation layer", raised into the loop)
    run = deepspeed_run(tmp_path, "loop", "zero3-partitioned")
    assert run["world"] == 2
    for name, held in run["before"].items():
        assert held == {"held": 0, "whole": 32, "status": "NOT_AVAILABLE"}, name
    assert run["off"] is None and run["disabled"] is None
    assert run["gathers"]["found"] == len(NORMS)  # one gather per norm, for its float64 check
    assert run["rows"] == [8 * 16] * len(NORMS)  # the hooks fired: every row of the global batch, once
    ladder, probe = split(run["history"])
    assert [h["step"] for h in ladder] == [0, 1] and [h["step"] for h in probe] == [0, 1, 1]
    assert all(f"lnmonitor/sigma/{name}" in ladder[-1] for name in NORMS)
    # the gains read after training, outside a forward, partitioned again: gathered whole (LayerNorm's
    # ones after two small updates), not the empty tensor each rank holds
    assert run["gathers"]["read"] == len(NORMS)
    assert all(abs(total - 32) < 1 for total in run["gains"].values()), run["gains"]


@pytest.fixture(scope="module")
def loop_ddp(tmp_path_factory):
    return deepspeed_run(tmp_path_factory.mktemp("ddp"), "loop", "ddp")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero2", "zero3", "zero3-partitioned"])
def test_the_loop_monitor_under_zero_matches_ddp(loop_ddp, tmp_path, mode):
    # the loop monitor around the engine (ZeRO-3 at the default threshold: the engine itself is given)
    # logs DDP's ladder, shares and probe at every step, and the gains after training are DDP's
    run = deepspeed_run(tmp_path, "loop", mode)
    assert run["off"] is None and run["disabled"] is None
    assert run["rows"] == loop_ddp["rows"] == [8 * 16] * len(NORMS)
    (ladder, probe), (ladder_ddp, probe_ddp) = split(run["history"]), split(loop_ddp["history"])
    assert_history_matches(ladder, ladder_ddp)
    assert [h["step"] for h in probe] == [h["step"] for h in probe_ddp] == [0, 1, 1]
    for a, b in zip(probe, probe_ddp, strict=True):
        assert_probe_matches(a, b)
    assert_probe_matches(run["invariance"], loop_ddp["invariance"])
    assert run["gains"] == pytest.approx(loop_ddp["gains"], rel=1e-6)
    partitioned = {name for name, p in run["before"].items() if p["status"] == "NOT_AVAILABLE"}
    assert partitioned == (set(run["before"]) if mode.startswith("zero3") else set())


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trainer")
    return {mode: deepspeed_run(folder, "trainer", mode) for mode in ("ddp", "zero2")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero3", "zero3-partitioned"])
def test_the_trainer_callback_under_zero_matches_ddp_and_refuses_the_probe_at_stage_3(trainer_runs, tmp_path,
                                                                                      mode):
    # ZeRO-2 measures the first step (the same weights) as DDP does within a bin, and probes as DDP;
    # the Trainer trains differently under DeepSpeed than under DDP (its logged grad_norm at step 2:
    # 0.7922 against 0.7727), so the later points are compared with ZeRO-2's, the same training
    # unpartitioned.  ZeRO-3's probe is refused in one message, the ladder goes on.
    ddp, zero2 = trainer_runs["ddp"], trainer_runs["zero2"]
    run = deepspeed_run(tmp_path, "trainer", mode)
    assert run["engine"] == zero2["engine"] == "DeepSpeedEngine"
    assert run["off"] is None and zero2["off"] is None and zero2["disabled"] is None
    assert run["disabled"] == SHARDED_REFUSED
    assert run["rows"] == zero2["rows"] == ddp["rows"] == [8 * 16] * len(NORMS)
    (ladder, probe), (ladder2, probe2), (ladder_ddp, probe_ddp) = (split(r["history"]) for r in (run, zero2,
                                                                                                 ddp))
    steps = lambda history: [h["step"] for h in history]  # noqa: E731
    assert probe == [] and steps(probe2) == steps(probe_ddp) == [2, 4, 4]
    assert steps(ladder) == steps(ladder2) == steps(ladder_ddp) == [1, 2, 4]
    assert_within_a_bin(ladder2[0], ladder_ddp[0])
    for a, b in zip(ladder, ladder2, strict=True):
        assert_within_a_bin(a, b)
    status = {p["status"] for p in run["after"].values()}
    assert status == ({"NOT_AVAILABLE"} if mode == "zero3-partitioned" else {"AVAILABLE"})


def assert_within_a_bin(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for tag, value in a.items():
        if tag != "step":
            assert value == pytest.approx(b[tag], **_tolerance(tag)), tag


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["deepspeed2", "deepspeed3"])
def test_lightnings_deepspeed_strategy_matches_one_process(single, tmp_path, strategy):  # noqa: F811
    # Lightning's DeepSpeedStrategy (every parameter partitioned at stage 3) with both monitors, run on
    # the CPU with its one CUDA check left out (tests/distributed_monitor_script.py deepspeed)
    two = lightning_run(strategy, 2, tmp_path / "out.json")
    assert two["world"] == 2 and two["off"] is None
    assert_matches_one_process(two, single)
    for key, value in two["invariance"][0].items():
        assert value == pytest.approx(single["invariance"][0][key], rel=1e-4, abs=1e-6), key


def test_lightning_refuses_its_deepspeed_strategy_on_the_cpu_before_any_callback_runs(tmp_path):
    # the exact reason Lightning's DeepSpeedStrategy cannot run on a CPU as it ships: its own check, in
    # setup_environment, before any callback hook (the monitors are never reached)
    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
    from lnmonitor.tiny.module import TinyGPTModule

    monitors = [LayerNormMonitor(every_n_steps=1), FinalNormInvarianceMonitor(invariance_every_n_steps=1)]
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=3), max_steps=1,
                        logger=False, enable_checkpointing=False, callbacks=monitors,
                        default_root_dir=tmp_path)
    module = TinyGPTModule("abcdefgh", width=16, depth=1, heads=2, context=8, max_steps=1)
    # Lightning's environment setup leaves MASTER_ADDR, MASTER_PORT and LOCAL_RANK behind, which
    # would make a later Trainer in this process start a process group: the environment restored
    refused = "The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used"
    with mock.patch.dict(os.environ), pytest.raises(RuntimeError, match=refused):
        trainer.fit(module)
