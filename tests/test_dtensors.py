"""DTensor norms read from their local rows, in one process on a mesh of one rank (gloo): the
same numbers as the plain model, and a layout whose local rows are not whole rows (the feature
dimension sharded, Partial) named once while the other norms are measured.  Several ranks are
tests/test_distributed.py's (slow)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from torch import nn

from lnmonitor.core import dtensors
from lnmonitor.core.meter.meter import LadderMeter


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class Stack(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.ln1 = nn.LayerNorm(d)
        self.mid = nn.Linear(d, d)
        self.ln2 = nn.RMSNorm(d)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.mid(self.ln1(h))
        return self.out(self.ln2(h))


def _measure(model, x) -> tuple[LadderMeter, dict]:
    meter = LadderMeter(model)
    return meter, _step(meter, model, x)


def _step(meter: LadderMeter, model, x) -> dict:
    with meter.step():
        model(x).square().mean().backward()
    return meter.result().metrics()


def test_layouts_whose_rows_are_not_whole_are_named(mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    t = torch.randn(2, 5, 8)
    assert dtensors.unsupported(t, DTensor.from_local(t, mesh, [Shard(1)])) is None
    assert dtensors.unsupported(DTensor.from_local(t, mesh, [Replicate()])) is None
    assert "feature dimension" in dtensors.unsupported(DTensor.from_local(t, mesh, [Shard(2)]))
    assert "feature dimension" in dtensors.unsupported(DTensor.from_local(t, mesh, [Shard(-1)]))
    assert "Partial" in dtensors.unsupported(t, DTensor.from_local(t, mesh, [Partial()]))


def test_sequence_parallel_norms_give_the_plain_models_numbers(mesh):
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    plain = Stack()
    tp = copy.deepcopy(plain)
    # both norms SequenceParallel: their input, output and gradient DTensors (the linears after
    # them take the local tensor back)
    parallelize_module(tp, mesh, {"ln1": SequenceParallel(use_local_output=True),
                                  "ln2": SequenceParallel(use_local_output=True)})
    x = torch.randn(4, 7, 6)
    ref_meter, ref = _measure(plain, x)
    meter, got = _measure(tp, x)
    assert meter.off_reason is None and not meter.refused
    # the same rows: every binned figure the same; the exact maximum share to float32 rounding (a
    # DTensor LayerNorm is reduced from its input, a plain one from what its backward saved)
    assert got.keys() == ref.keys()
    for key, value in got.items():
        assert value == (pytest.approx(ref[key], abs=1e-6) if "share_max" in key else ref[key]), key
    assert [n.role for n in meter.norms] == [n.role for n in ref_meter.norms]


def test_a_feature_sharded_norm_is_named_once_and_the_others_measured(mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    torch.manual_seed(0)
    model = Stack()
    # ln1 reads its input sharded along the features (each rank would hold part of every row)
    parallelize_module(model, mesh, {"ln1": PrepareModuleInputOutput(
        input_layouts=Replicate(), desired_input_layouts=Shard(2), output_layouts=Shard(2),
        desired_output_layouts=Replicate(), use_local_output=True)})
    for name in ("weight", "bias"):
        setattr(model.ln1, name, nn.Parameter(dtensors_replicated(getattr(model.ln1, name), mesh)))
    x = torch.randn(4, 7, 6)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        meter = LadderMeter(model)
        first, second = (_step(meter, model, x) for _ in range(2))  # the second step says nothing again
    assert meter.off_reason is None
    assert list(meter.refused) == ["ln1"] and "Shard(dim=2)" in meter.refused["ln1"]
    messages = [str(w.message) for w in said if "laid out across processes" in str(w.message)]
    assert len(messages) == 1 and "ln1" in messages[0] and "feature dimension" in messages[0]
    assert "lnmonitor/sigma/ln2" in first and "lnmonitor/share_median/ln2" in first and second
    assert not any(key.startswith(("lnmonitor/sigma/ln1", "lnmonitor/share_median/ln1")) for key in first)
    assert "lnmonitor/ladder/attenuation" not in first  # one rung left: no ladder of one


def dtensors_replicated(weight, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(weight.detach(), mesh, [Replicate()])
