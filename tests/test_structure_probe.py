"""StructureProbe on real Trainers: what it logs, its cadence, resume, validate-only runs and setup errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import (
    PROBE_WIDTH,
    MemoryLogger,
    trainer,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader

from lnmonitor import StructureProbe
from lnmonitor.core.norms.find import find_norms
from lnmonitor.tiny.module import TinyGPTModule


def test_probe_logs_rank_and_gain_spread_under_lnmonitor_probe(trained):
    probe, logger = trained["probe"], trained["logger"]
    logged = [m for _, m in logger.logged if any(k.startswith("lnmonitor/probe/") for k in m)]
    assert len(logged) == 2  # two validation runs (steps 30 and 60), no sanity check
    last = logged[-1]
    assert last["lnmonitor/probe/block_rank/model.blocks.0"] == PROBE_WIDTH
    assert last["lnmonitor/probe/branch_rank/model.blocks.1"] < PROBE_WIDTH
    for key in ("block_sv_min", "block_sv_max", "branch_sv_min", "branch_sv_max"):
        assert f"lnmonitor/probe/{key}/model.blocks.1" in last
    spreads = {k: v for k, v in last.items() if k.startswith("lnmonitor/probe/gain_spread/")}
    assert set(spreads) == {f"lnmonitor/probe/gain_spread/{i.name}" for i in find_norms(trained["module"])}
    assert all(math.isfinite(v) and v >= 1.0 for v in spreads.values())
    assert probe.last is not None and probe.last.position == 31 and probe.last.step == 60


def small_module():
    return TinyGPTModule("abcdefgh", width=16, depth=1, heads=2, context=8, max_steps=4)


def small_loader(n=2):
    idx = torch.randint(0, 8, (n, 4, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader([(x, x) for x in idx], batch_size=None)


def test_probe_setup_says_what_to_do_when_the_model_has_no_blocks():
    class NoBlocks(TinyGPTModule):
        def __init__(self):
            super().__init__("abcdefgh", width=16, depth=1, heads=2, context=8)
            self.model.blocks = nn.Sequential(*self.model.blocks)  # not a ModuleList

    with pytest.raises(MisconfigurationException, match="blocks='...'"):
        trainer(4, [StructureProbe()]).validate(NoBlocks(), small_loader(), verbose=False)
    with pytest.raises(MisconfigurationException, match="no submodule 'model.layers'"):
        trainer(4, [StructureProbe(blocks="model.layers")]).validate(
            small_module(), small_loader(), verbose=False)


def test_probe_cadence_sanity_check_and_no_hooks_left():
    probe = StructureProbe(every_n_validations=2, position=3)
    logger = MemoryLogger()
    module = small_module()
    t = trainer(4, [probe], logger=logger, val_check_interval=1, check_val_every_n_epoch=None,
                num_sanity_val_steps=1, log_every_n_steps=1)
    t.fit(module, small_loader(4), small_loader())
    steps = [s for s, m in logger.logged if "lnmonitor/probe/block_rank/model.blocks.0" in m]
    assert steps == [1, 3]  # validations after steps 1..4, every second one; not the sanity check
    assert probe.state_dict() == {"validations": 4}
    assert probe.state_key == "StructureProbe{'every_n_validations': 2, 'position': 3, 'blocks': None}"
    for m in module.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert probe.last.blocks[0].position == 3


def test_probe_resumes_its_cadence_from_a_checkpoint(tmp_path):
    first = StructureProbe(every_n_validations=2)
    t = trainer(3, [first], val_check_interval=1, check_val_every_n_epoch=None,
                num_sanity_val_steps=0)
    t.fit(small_module(), small_loader(4), small_loader())
    t.save_checkpoint(tmp_path / "three.ckpt")
    resumed, logger = StructureProbe(every_n_validations=2), MemoryLogger()
    t = trainer(4, [resumed], logger=logger, val_check_interval=1,
                check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=1)
    t.fit(small_module(), small_loader(4), small_loader(), ckpt_path=tmp_path / "three.ckpt")
    steps = [s for s, m in logger.logged if "lnmonitor/probe/block_rank/model.blocks.0" in m]
    assert resumed.state_dict() == {"validations": 4} and steps == []  # 4th validation: not due


def test_probe_runs_under_trainer_validate_inference_mode():
    probe = StructureProbe()
    module = small_module()
    trainer(4, [probe]).validate(module, small_loader(), verbose=False)
    assert probe.last.blocks[0].block_rank == 16 and probe.last.blocks[0].branch_rank < 16
    assert len(probe.last.norms) == 3


def test_structure_probe_is_exported():
    import lnmonitor

    assert lnmonitor.StructureProbe is StructureProbe


class UncopyableBlocks(TinyGPTModule):
    """Its blocks refuse deepcopy from the first validation on (as an FSDP module does)."""

    def on_validation_epoch_start(self):
        for block in self.model.blocks:
            block.__class__ = type("Uncopyable", (type(block),), {"__deepcopy__": self._refuse})

    @staticmethod
    def _refuse(*args):
        raise RuntimeError("this block cannot be copied")


def test_an_error_while_probing_turns_the_probe_off_and_training_goes_on():
    module = UncopyableBlocks("abcdefgh", width=16, depth=1, heads=2, context=8, max_steps=3)
    probe = StructureProbe()
    t = trainer(3, [probe], val_check_interval=1, check_val_every_n_epoch=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module, small_loader(4), small_loader())
    assert t.global_step == 3 and probe.last is None
    said = [str(w.message) for w in caught if "StructureProbe is off" in str(w.message)]
    assert len(said) == 1 and "cannot be copied" in said[0]
