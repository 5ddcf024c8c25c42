"""lnmonitor.core.probes.structure on a freshly trained tiny GPT: each norm's Jacobian against autograd, block
versus branch rank, gain spread."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import (
    PROBE_WIDTH,
)
from torch import nn

from lnmonitor.core.maths import random_baseline
from lnmonitor.core.meter.heldout import held_out_result
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.norms.find import find_norms
from lnmonitor.core.probes.blocks import SequenceCapture, find_blocks, resolve_branch
from lnmonitor.core.probes.structure import numerical_rank, probe_block_rank, probe_norm_jacobian
from lnmonitor.tiny.module import TinyGPTModule


def captured(module, batch):
    norms = find_norms(module)
    blocks = find_blocks(module, norms)
    with torch.no_grad(), SequenceCapture(blocks, norms) as cap:
        module(batch[0][:1])
    return norms, blocks, cap



def test_every_norm_jacobian_matches_autograd_to_float64_precision(trained):
    module = trained["module"]
    norms, _, cap = captured(module, trained["batches"][0])
    assert len(norms) == 5  # 2 blocks x (ln1, ln2) + lnf
    for info in norms:
        for position in (0, -1):
            p = probe_norm_jacobian(info, cap.norms[info.name][position])
            assert p.max_abs_error <= 1e-13 * p.max_abs_entry, (info.name, p.max_abs_error)
            # the scale direction passes eps/(v+eps): rank d-1 at the module's eps, d-2 at 0
            assert p.rank == PROBE_WIDTH - 1 and p.rank_eps0 == PROBE_WIDTH - 2, info.name
            assert 0 < p.transmission < 0.1
            assert p.singular_values[-2] == pytest.approx(p.transmission * p.inv_sigma, rel=0.5)


def test_residual_restores_full_rank_the_branch_does_not(trained):
    module = trained["module"]
    norms, blocks, cap = captured(module, trained["batches"][0])
    assert [name for name, _ in blocks] == ["model.blocks.0", "model.blocks.1"]
    for name, block in blocks:
        for position in (0, 17, -1):
            p = probe_block_rank(block, cap.blocks[name], norms, position=position, name=name)
            assert p.branch == "ln1 -> attn"
            assert p.block_rank == PROBE_WIDTH and p.block_sv_min > 1e-3, (name, position, p.block_sv_min)
            assert p.branch_rank < PROBE_WIDTH, (name, position)
            assert p.branch_sv_min < 1e-12 * p.branch_sv_max  # ln1 deletes the 1 direction exactly
            assert "numpy" in p.rank_rule and p.block_tol == pytest.approx(
                p.block_sv_max * PROBE_WIDTH * np.finfo(np.float64).eps)


def test_gain_spread_is_finite_reported_and_moved_by_training(trained):
    module = trained["module"]
    norms, _, cap = captured(module, trained["batches"][0])
    for info in norms:
        p = probe_norm_jacobian(info, cap.norms[info.name][-1])
        assert math.isfinite(p.gain_spread) and 1.0 < p.gain_spread < 10.0, info.name
        g = info.gain().detach().double().abs()
        assert p.gain_spread <= float(g.max() / g.min()) * (1 + 1e-9)  # P cannot add spread
    fresh = TinyGPTModule(module.vocab.chars, width=PROBE_WIDTH, depth=2, heads=2, context=32)
    info = find_norms(fresh)[0]
    p = probe_norm_jacobian(info, torch.randn(PROBE_WIDTH))
    assert p.gain_spread == pytest.approx(1.0, abs=1e-12)  # gain of ones: a flat spectrum


def test_block_jacobian_equals_a_direct_autograd_jacobian(trained):
    module = trained["module"]
    norms, blocks, cap = captured(module, trained["batches"][0])
    name, block = blocks[1]
    h = cap.blocks[name].double()
    reference = copy.deepcopy(block).double()
    pos = 20

    def at(row):
        seq = torch.cat([h[:pos], row[None], h[pos + 1:]])
        return reference(seq[None])[0, pos]

    direct = torch.autograd.functional.jacobian(at, h[pos].clone())
    p = probe_block_rank(block, cap.blocks[name], norms, position=pos)
    np.testing.assert_allclose(p.block_singular_values, torch.linalg.svdvals(direct).numpy(),
                               rtol=1e-10, atol=1e-14)
    assert block.ln1.weight.dtype == torch.float32  # the model was not touched


def test_block_without_a_residual_loses_rank():
    class Bare(nn.Module):  # ln -> linear, no residual: rank at most d - 1
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(self.ln(x))

    class Residual(Bare):
        def forward(self, x):
            return x + self.fc(self.ln(x))

    torch.manual_seed(0)
    h = torch.randn(5, 16)
    block = Bare()
    bare = probe_block_rank(block, h, find_norms(block), position=2)
    assert bare.block_rank == 15 and bare.branch_rank == 15 and bare.branch == "ln -> fc"
    block = Residual()
    res = probe_block_rank(block, h, find_norms(block), position=2)
    assert res.block_rank == 16 and res.branch_rank == 15


def test_numerical_rank_states_its_tolerance():
    sv = torch.tensor([2.0, 1.0, 1e-9, 1e-20], dtype=torch.float64)
    assert numerical_rank(sv) == (3, 2.0 * 4 * np.finfo(np.float64).eps)
    assert numerical_rank(sv, rtol=1e-6) == (2, 2e-6)


def test_find_blocks_and_branch_resolution(trained):
    module = trained["module"]
    norms = find_norms(module)
    assert [n for n, _ in find_blocks(module, norms, "model.blocks")] == ["model.blocks.0", "model.blocks.1"]
    with pytest.raises(ValueError, match="no submodule"):
        find_blocks(module, norms, "model.layers")
    with pytest.raises(ValueError, match="not a non-empty ModuleList"):
        find_blocks(module, norms, "model.lnf")
    with pytest.raises(ValueError, match="ModuleList of repeated blocks"):
        seq = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        find_blocks(seq, find_norms(seq))
    block = module.model.blocks[0]
    assert resolve_branch(block, norms)[0] == "ln1 -> attn"
    assert resolve_branch(block, norms, ("ln2", "mlp"))[0] == "ln2 -> mlp"
    with pytest.raises(ValueError, match="no child 'norm'"):
        resolve_branch(block, norms, ("norm", "attn"))
    with pytest.raises(ValueError, match="cannot find the branch"):
        resolve_branch(nn.Linear(4, 4), [])


def test_rmsnorm_model_has_a_one_dimensional_dead_subspace():
    torch.manual_seed(1)
    module = TinyGPTModule("abcdefgh", width=16, depth=1, heads=2, context=8, norm="rms").eval()
    idx = torch.randint(0, 8, (2, 8))
    norms, blocks, cap = captured(module, (idx, idx))
    p = probe_norm_jacobian(norms[0], cap.norms[norms[0].name][3])
    assert p.kind == "rms" and p.rank == 16 and p.rank_eps0 == 15
    assert p.max_abs_error <= 1e-13 * p.max_abs_entry
    b = probe_block_rank(blocks[0][1], cap.blocks[blocks[0][0]], norms, position=3)
    # RMSNorm deletes only the scale direction, and passes eps/(ms+eps) of it: numerically full
    # rank at numpy's tolerance, one short at a relative 1e-3.
    assert b.block_rank == 16 and b.branch_rank == 16 and b.branch_sv_min < 1e-3 * b.branch_sv_max
    loose = probe_block_rank(blocks[0][1], cap.blocks[blocks[0][0]], norms, position=3, rtol=1e-3)
    assert loose.block_rank == 16 and loose.branch_rank == 15 and loose.rank_rule == "sv > 0.001 * s_max"
    result = held_out_result(LadderMeter(module), [(idx, idx)], lambda m, bt: m(*bt)[1])
    assert result.figures.baseline(norms[0].name)[0] == pytest.approx(random_baseline.share_median(16, 1))
