"""lnmonitor.core.heldout: float64 shares against a direct autograd computation, and the ladder's
stream points."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (
    PROBE_WIDTH,
)

from lnmonitor.core import geometry
from lnmonitor.core.heldout import measure_norm_rows, share_table, sigma_ladder
from lnmonitor.core.norms import find_norms


def test_shares_match_a_direct_autograd_computation_and_grads_stay_untouched(trained):
    module = trained["module"]
    batches = trained["batches"][:1]
    rows = measure_norm_rows(module, batches, lambda m, b: m(*b)[1], find_norms(module))
    assert all(p.grad is None for p in module.parameters())
    names = [r.name for r in rows]
    assert names == ["model.blocks.0.ln1", "model.blocks.0.ln2", "model.blocks.1.ln1",
                     "model.blocks.1.ln2", "model.lnf"]  # call order

    # direct: retain the final norm's input and output gradient, w = g * dL/dy
    lnf = module.model.lnf
    kept = {}

    def hook(mod, args, out):
        kept["x"] = args[0].detach()
        out.register_hook(lambda g: kept.__setitem__("g", g))

    handle = lnf.register_forward_hook(hook)
    with torch.enable_grad():
        module(*batches[0])[1].backward()
    handle.remove()
    module.zero_grad(set_to_none=True)
    x = kept["x"].reshape(-1, PROBE_WIDTH).double()
    w = (lnf.weight.detach().double() * kept["g"].reshape(-1, PROBE_WIDTH).double())
    u1 = torch.full((PROBE_WIDTH,), PROBE_WIDTH**-0.5, dtype=torch.float64)
    xc = x - x.mean(-1, keepdim=True)
    u2 = xc / xc.norm(dim=-1, keepdim=True)
    direct = torch.sqrt((w @ u1) ** 2 + (w * u2).sum(-1) ** 2) / w.norm(dim=-1)
    np.testing.assert_allclose(rows[-1].share, direct.numpy(), rtol=1e-9)

    table = share_table(rows)
    n = batches[0][0].numel()
    for row in table:
        assert row.rows + row.skipped == n
        assert row.baseline_median == pytest.approx(geometry.share_median(PROBE_WIDTH, 2))
        assert row.baseline_max == pytest.approx(geometry.max_share_median(PROBE_WIDTH, 2, row.rows))
        assert row.deletion_cost == pytest.approx(1 - math.sqrt(1 - row.median**2))


def test_ladder_reads_the_residual_stream_points_of_the_tiny_gpt(trained):
    """Model-specific check: the norms' inputs are embedding, after each attention, after each MLP."""
    module = trained["module"]
    batch = trained["batches"][0]
    rows = measure_norm_rows(module, [batch], lambda m, b: m(*b)[1], find_norms(module))
    gpt = module.model
    with torch.no_grad():
        x = gpt.tok_emb(batch[0]) + gpt.pos_emb(torch.arange(batch[0].shape[1]))
        points = [x]
        for block in gpt.blocks:
            x = x + block.attn(block.ln1(x))
            points.append(x)
            x = x + block.mlp(block.ln2(x))
            points.append(x)
    assert len(points) == len(rows)
    for r, p in zip(rows, points, strict=True):
        p = p.reshape(-1, PROBE_WIDTH).double()
        np.testing.assert_allclose(r.rms, p.pow(2).mean(-1).sqrt().numpy(), rtol=1e-5)
        sigma = torch.sqrt(p.var(-1, unbiased=False) + 1e-5)
        np.testing.assert_allclose(r.sigma, sigma.numpy(), rtol=1e-5)
    ladder, attenuation, growth = sigma_ladder(rows, {"model.blocks.0.ln1": "embedding"})
    assert ladder[0].point == "embedding" and ladder[1].point == "input of model.blocks.0.ln2"
    assert attenuation == pytest.approx(ladder[0].inv_sigma / ladder[-1].inv_sigma)
    assert growth == pytest.approx(ladder[-1].rms / ladder[0].rms)
