"""lnmonitor.core.maths.reductions: the hot path's per-row numbers, by either path, equal each other
and float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lnmonitor.core import torch_internals
from lnmonitor.core.maths.reductions import (
    drop_rounding_rows,
    finish_layernorm_backward,
    finish_rows,
    layernorm_backward_raw,
    mask_rows,
    row_raw,
    row_values,
    stack_raw,
)
from lnmonitor.core.meter.taps import NormTap
from lnmonitor.core.norms.find import find_norms


def row_reductions(x, g, kind, weight=None):
    """The (5, rows) reductions of one call from its input, as the taps compose the halves."""
    return finish_rows(stack_raw([row_raw(x, g, kind, weight)]), kind, x.shape[-1])


def layernorm_backward_reductions(g, dx, mean, rstd, eps, weight=None):
    """The same from what a LayerNorm's backward has, as the taps compose the halves."""
    return finish_layernorm_backward(stack_raw([layernorm_backward_raw(g, dx, mean, rstd, weight)]), eps,
                                     g.shape[-1])


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


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_finishing_calls_together_equals_finishing_each_to_the_bit(kind):
    # the taps finish a step's calls side by side, once; each call alone gives the same bits
    torch.manual_seed(6)
    calls = [(torch.randn(rows, 48) * scale, torch.randn(rows, 48) * 1e-3, torch.rand(48) + 0.5)
             for rows, scale in ((40, 1.0), (40, 30.0), (40, 0.01))]
    alone = torch.cat([drop_rounding_rows(row_reductions(x, g, kind, w)) for x, g, w in calls], dim=1)
    together = finish_rows(stack_raw([row_raw(x, g, kind, w) for x, g, w in calls]), kind, 48)
    drop_rounding_rows(together.view(5, 3, 40))
    assert torch.equal(alone, together)
    ln = nn.LayerNorm(48)
    raws, singles = [], []
    for x, g, _ in calls:
        y = ln(x.requires_grad_())
        mean, rstd = torch_internals.layernorm_saved_stats(y, x.shape[0])
        (dx,) = torch.autograd.grad(y, x, g)
        raws.append(layernorm_backward_raw(g, dx, mean, rstd, ln.weight))
        singles.append(drop_rounding_rows(layernorm_backward_reductions(g, dx, mean, rstd, 1e-5, ln.weight)))
    together = finish_layernorm_backward(stack_raw(raws), 1e-5, 48)
    drop_rounding_rows(together.view(5, 3, 40))
    assert torch.equal(torch.cat(singles, dim=1), together)


def test_a_tapped_step_finishes_each_call_as_alone_padding_included():
    # two widths (two groups finished apart) and a padding mask on one call only
    torch.manual_seed(7)
    model = nn.ModuleDict({"narrow": nn.RMSNorm(16, eps=1e-6), "wide": nn.RMSNorm(32, eps=1e-6)})
    tap = NormTap(sorted(find_norms(model), key=lambda n: n.name))
    a, b = torch.randn(6, 16, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    keep = torch.tensor([True, True, False, True, False, True])
    tap.attach()
    tap.row_mask = keep
    ya = model["narrow"](a)
    tap.row_mask = None
    yb = model["wide"](b)
    (ya ** 3).sum().add((yb ** 3).sum()).backward()
    rows = tap.collect()
    tap.detach()
    want = [mask_rows(row_reductions(a.detach(), 3 * ya.detach() ** 2, "rms", model["narrow"].weight), keep),
            row_reductions(b.detach(), 3 * yb.detach() ** 2, "rms", model["wide"].weight)]
    got = dict(zip([r.norm for r in rows.records], torch.split(rows.data, [r.rows for r in rows.records], 1),
                   strict=True))
    for index, expected in enumerate(want):
        assert torch.equal(got[index].isnan(), drop_rounding_rows(expected).isnan())
        torch.testing.assert_close(got[index], expected, rtol=1e-6, atol=0, equal_nan=True)
    assert int(rows.pads[0]) == 2 and 1 not in rows.pads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_reduced_in_chunks_equal_rows_reduced_at_once(monkeypatch, dtype):
    # wide norms and long batches are reduced a chunk of rows at a time (bounded temporaries)
    import lnmonitor.core.maths.reductions as R

    torch.manual_seed(8)
    x, g, gain = torch.randn(300, 48).to(dtype), torch.randn(300, 48).to(dtype), torch.rand(48) + 0.5
    y = nn.LayerNorm(48).to(dtype)(x.clone().requires_grad_())
    mean, rstd = torch_internals.layernorm_saved_stats(y, 300)
    dx = torch.randn(300, 48).to(dtype)  # the raw numbers of each row are what is compared
    whole = [R.row_raw(x, g, kind, gain) for kind in ("layer", "rms")]
    whole.append(R.layernorm_backward_raw(g, dx, mean, rstd, gain))
    monkeypatch.setattr(R, "CHUNK_ELEMENTS", 7 * 48 + 5)  # chunks of 7 rows, the last one short
    assert R.chunk_rows(48) == 7
    workspace = (torch.empty(7 * 48), torch.empty(7 * 48))
    chunked = [R.row_raw(x, g, kind, gain, workspace) for kind in ("layer", "rms")]
    chunked.append(R.layernorm_backward_raw(g, dx, mean, rstd, gain, (torch.empty(7 * 48),)))
    for a, b in zip(whole, chunked, strict=True):  # a sum of 48 terms may round apart
        torch.testing.assert_close(stack_raw([a]), stack_raw([b]), rtol=1e-5, atol=1e-5)
