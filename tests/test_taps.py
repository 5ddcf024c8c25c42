"""lnmonitor.core.meter.taps: the hooks' per-row numbers against an independent float64 computation, hooks and
references left behind, autocast and loss scaling, skipped rows."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from conftest import (
    Net,
    qr_share,
    run_tap,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from lnmonitor.core import torch_internals
from lnmonitor.core.maths.reductions import row_values
from lnmonitor.core.meter import row_stats as H
from lnmonitor.core.meter import row_stats as R
from lnmonitor.core.meter.taps import NormTap
from lnmonitor.core.norms.find import find_norms


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_rows_match_float64(kind):
    torch.manual_seed(0)
    model = Net(48, kind)
    x = torch.randn(5, 7, 6)
    norms, rows, cap = run_tap(model, x)
    assert rows.order == [0, 1]
    assert [r[0] for r in rows.records] == [1, 0]  # gradients arrive in reverse
    start = 0
    for index, count, d, eps, k in rows.records:
        info = norms[index]
        xin, g = (t.double().reshape(-1, d).numpy() for t in cap[index])
        w = g * info.gain().detach().double().numpy()
        chunk = rows.data[:, start : start + count]
        start += count
        share, ok, var, ms, stat_ok = row_values(chunk, float(d), float(k == 2))
        assert ok.all() and stat_ok.all()
        ref = qr_share(xin, w, kind)
        np.testing.assert_allclose(share.numpy(), ref, atol=1e-4)
        v_ref = xin.var(1) if kind == "layer" else (xin**2).mean(1)
        np.testing.assert_allclose(var.numpy(), v_ref, rtol=1e-4)
        np.testing.assert_allclose(np.sqrt(var.numpy() + eps), np.sqrt(v_ref + eps), rtol=1e-4)
        np.testing.assert_allclose(eps / var.numpy(), eps / v_ref, rtol=1e-4)
        np.testing.assert_allclose(ms.numpy(), (xin**2).mean(1), rtol=1e-4)


def test_no_hooks_and_no_references_left():
    torch.manual_seed(0)
    model = Net(16, "layer")
    norms = find_norms(model)
    tap = NormTap(norms)
    tap.attach()
    assert all(len(n.module._forward_hooks) == 1 for n in norms)
    out = model(torch.randn(3, 6)).sum()
    assert len(tap._pending) == 2  # references to the two inputs, nothing copied
    out.backward()
    assert tap._pending == []
    tap.detach()
    assert tap.collect().data.shape == (5, 6)
    assert all(len(n.module._forward_hooks) == 0 for n in norms)
    # a forward without gradient is ignored; one without backward is dropped by detach()
    tap.attach()
    with torch.no_grad():
        model(torch.randn(3, 6))
    assert tap._pending == []
    model(torch.randn(3, 6))
    assert len(tap._pending) == 2
    tap.detach()
    assert tap._pending == []
    rows = tap.collect()
    assert rows.data is None and rows.records == []


@pytest.mark.parametrize("norm", [nn.LayerNorm(16), nn.RMSNorm(16)], ids=["layer", "rms"])
@pytest.mark.parametrize("bypass", [False, True], ids=["plain", "bypass"])
def test_a_norm_input_is_let_go_once_its_backward_has_run(norm, bypass):
    """The taps hold a norm's input only until they have measured it: the activation is
    freed while the graph, and the hooks holding the tap's boxes, still live."""
    tap = NormTap(find_norms(nn.Sequential(norm)))
    tap.attach(bypass=bypass)
    leaf = torch.randn(4, 16, requires_grad=True)
    stream = leaf * 2.0  # only the norm keeps it (a product by a constant saves nothing)
    alive = weakref.ref(stream)
    seen = []
    leaf.register_hook(lambda g: seen.append(alive() is None))  # the graph lives on until this returns
    loss = (norm(stream) * torch.arange(16.0)).sum()
    del stream
    loss.backward()
    tap.detach()
    assert seen == [True]
    assert tap.collect().data.shape == (5, 4)  # and it was measured


def test_bfloat16_autocast_is_measured_in_float32():
    torch.manual_seed(0)
    model = Net(32, "layer")
    norms, rows, cap = run_tap(model, torch.randn(4, 6), dtype=torch.bfloat16)
    assert rows.data.dtype == torch.float32
    share, ok, *_ = row_values(rows.data, 32.0, 1.0)
    assert ok.all() and torch.isfinite(share).all()


def test_skipped_rows_zero_and_nonfinite():
    d = 16
    norm = nn.LayerNorm(d, elementwise_affine=False)
    info = find_norms(nn.Sequential(norm))
    tap = NormTap(info)
    tap.attach()
    x = torch.randn(6, d)
    x[1] = float("nan")
    x[2] = 3.0  # constant row: var 0, no dead plane direction
    y = norm(x.requires_grad_())
    mask = torch.ones(6, 1)
    mask[1] = 0.0
    mask[4] = 0.0  # zero gradient
    (torch.where(mask > 0, y, 0.0) * torch.arange(d)).sum().backward()
    rows = tap.collect()
    tap.detach()
    layout = H.Layout(1)
    stats = R.read(R.histogram_rows(rows, layout, "cpu")[: layout.max_end], layout)[0]
    assert stats.rows == 6
    assert stats.var_counts.sum() == 4  # nan row and constant row have no sigma
    # the zero-gradient row (finite input) has no gradient: counted apart from the faults, the
    # nan row and the constant row (whether its position had a target, the final norm tells)
    assert stats.share_rows == 3 and stats.zero_grad_rows == 1 and stats.skipped_rows == 2
    assert 0.0 <= stats.share_quantile(0.5) <= 1.0


class TwoNorms(nn.Module):
    """A LayerNorm (read from its own backward) and an RMSNorm (read from its input) on the
    same rows; row r of the loss is weighted by c[r], so its gradient has that size."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d, eps=1e-5)
        self.v1 = nn.Linear(d, 1, bias=False)
        self.v2 = nn.Linear(d, 1, bias=False)
        with torch.no_grad():
            for n in (self.ln, self.rms):
                n.weight.uniform_(0.5, 1.5)

    def forward(self, x, c):
        h = self.inp(x)
        out = self.v1(self.ln(h)) + self.v2(self.rms(h))
        return (out.squeeze(-1).float() * c).sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_statistics_in_float32_loss_scale_free_overflow_counted(dtype):
    """Under CPU autocast the rows are reduced in float32 (sigma to float32 precision, not
    the low dtype's); multiplying the loss by 2**16, as a GradScaler does, leaves every
    share unchanged; in fp16 the rows whose scaled gradient overflows are skipped and
    counted, exactly the rows with a non-finite dL/dy."""
    torch.manual_seed(0)
    d, rows = 32, 8
    model = TwoNorms(d)
    x = torch.randn(rows, d)
    c = torch.tensor([2.0**-4] * 4 + [2.0**4] * 4)  # rows 4..7 overflow fp16 at scale 2**16
    norms = find_norms(model)

    def run(scale):
        tap = NormTap(norms)
        seen = {}
        for info in norms:
            def hook(m, a, o, name=info.name):
                seen[name] = [a[0].detach()]
                o.register_hook(lambda g, name=name: seen[name].append(g.detach()))
            info.module.register_forward_hook(hook)
        tap.attach()
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x, c)
        (loss * scale).backward()
        tap.detach()
        for info in norms:
            info.module._forward_hooks.clear()
        model.zero_grad()
        out = tap.collect()
        assert out.data.dtype == torch.float32
        return out, seen

    plain, _ = run(1.0)
    scaled, seen = run(2.0**16)
    layout = H.Layout(len(norms))
    stats = R.read(R.histogram_rows(scaled, layout, "cpu")[: layout.max_end], layout)
    for i, info in enumerate(norms):
        x_in, g = seen[info.name]
        assert x_in.dtype == dtype and g.dtype == dtype  # the norm really ran in low precision
        bad = ~torch.isfinite(g).all(-1)
        assert int(bad.sum()) == (4 if dtype == torch.float16 else 0)
        assert stats[i].skipped_rows == int(bad.sum())
        assert stats[i].var_counts.sum() == rows  # the inputs are fine: sigma of every row
        sel = [k for k, r in enumerate(scaled.records) if r[0] == i]
        assert len(sel) == 1
        start = sum(r[1] for r in scaled.records[: sel[0]])
        k = 1.0 if info.kind == "layer" else 0.0
        part = slice(start, start + rows)
        s_scaled, ok_scaled, var, *_ = row_values(scaled.data[:, part], float(d), k)
        start1 = sum(r[1] for r in plain.records[: [j for j, r in enumerate(plain.records)
                                                    if r[0] == i][0]])
        s_plain, ok_plain, *_ = row_values(plain.data[:, start1:start1 + rows], float(d), k)
        assert ok_plain.all() and torch.equal(ok_scaled, ~bad)
        torch.testing.assert_close(s_scaled[~bad], s_plain[~bad], rtol=0, atol=1e-6)
        # float32 reduction of the low-precision input: 1e-5 relative, where fp16/bf16
        # arithmetic would be off by 1e-3/1e-2
        x64 = x_in.double()
        v_ref = x64.var(-1, unbiased=False) if info.kind == "layer" else x64.square().mean(-1)
        torch.testing.assert_close(var.double(), v_ref, rtol=1e-5, atol=0)


class Checkpointed(nn.Module):
    """Two norms inside a region that non-reentrant checkpointing recomputes in the backward."""

    def __init__(self, d: int = 24):
        super().__init__()
        self.net = Net(d, "layer")

    def forward(self, x):
        return checkpoint(self.net, x, use_reentrant=False)


@pytest.mark.parametrize("missing", ["graph_task", "saved_hooks", "saved_stats", "all"])
def test_without_torch_private_apis_the_taps_take_the_plain_path(monkeypatch, missing):
    """Each private torch API the taps use has a fallback: with it gone (a rename in torch),
    the rows are the same to float32 rounding and every call is still counted once."""
    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(5, 7, 6)
    _, before, _ = run_tap(model, x)
    if missing in ("graph_task", "all"):
        monkeypatch.setattr(torch_internals, "_graph_task_id", None)
    if missing in ("saved_hooks", "all"):
        monkeypatch.setattr(torch_internals, "_top_saved_hooks", None)
    if missing in ("saved_stats", "all"):
        monkeypatch.setattr(torch_internals, "_saved_stats_readable", False)
    model.zero_grad()
    _, after, _ = run_tap(model, x)
    assert [r[:2] for r in after.records] == [r[:2] for r in before.records]  # each call once
    torch.testing.assert_close(after.data, before.data, rtol=2e-5, atol=1e-6)
