"""lnmonitor.core.reductions: the hot path's per-row numbers, by either path, equal each other and float64."""

from __future__ import annotations

import torch
from torch import nn

from lnmonitor.core import torch_internals
from lnmonitor.core.reductions import layernorm_backward_reductions, row_reductions, row_values


def test_layernorm_backward_path_matches_the_input_path():
    torch.manual_seed(5)
    x = 0.7 + 1.3 * torch.randn(300, 64)
    g = torch.randn(300, 64) * 1e-3
    ln = nn.LayerNorm(64, eps=1e-5)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    y = ln(x.requires_grad_())
    mean, rstd = torch_internals.layernorm_saved_stats(y, 300)
    (dx,) = torch.autograd.grad(y, x, g)
    fast = layernorm_backward_reductions(g, dx, mean, rstd, 1e-5, ln.weight)
    slow = row_reductions(x, g, "layer", ln.weight)
    torch.testing.assert_close(fast[:4], slow[:4], rtol=2e-5, atol=0)
    s_fast = row_values(fast, 64.0, 1.0)[0]
    s_slow = row_values(slow, 64.0, 1.0)[0]
    torch.testing.assert_close(s_fast, s_slow, rtol=0, atol=2e-5)
    assert torch_internals.layernorm_saved_stats(nn.RMSNorm(64)(x), 300) is None
