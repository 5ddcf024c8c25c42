"""lnmonitor.taps and lnmonitor.summaries: norm discovery, the hooks' per-row numbers
against an independent float64 computation, skipped rows, and the mergeable summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import qr_share
from torch import nn

from lnmonitor import summaries as S
from lnmonitor import taps

# ---------------------------------------------------------------------------
# discovery
# ---------------------------------------------------------------------------


class DuckNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.normalized_shape = (d,)
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight, None, self.eps)


class DuckRMSNorm(DuckNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DeclaredNorm(nn.Module):
    lnmonitor_norm_kind = "rms"

    def __init__(self, d):
        super().__init__()
        self.variance_epsilon = 1e-6
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight


class ForeignNorm(nn.Module):  # like HF's LlamaRMSNorm: no normalized_shape
    def __init__(self, d):
        super().__init__()
        self.my_eps = 1e-4
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.my_eps) * self.scale


class OptedOut(nn.LayerNorm):
    lnmonitor_norm_kind = None


def test_discovery_kinds_order_and_protocol():
    model = nn.Sequential(
        nn.LayerNorm(8),
        nn.RMSNorm(8),
        DuckNorm(8),
        DuckRMSNorm(8),
        DeclaredNorm(8),
        ForeignNorm(8),
        OptedOut(8),
        nn.GroupNorm(2, 8),
        nn.BatchNorm1d(8),
    )
    found = taps.find_norms(model)
    assert [(f.name, f.kind) for f in found] == [
        ("0", "layer"), ("1", "rms"), ("2", "layer"), ("3", "rms"), ("4", "rms"),
    ]
    assert found[4].eps() == 1e-6
    assert found[1].eps(torch.float32) == torch.finfo(torch.float32).eps  # nn.RMSNorm eps=None
    assert found[1].eps(torch.bfloat16) == torch.finfo(torch.bfloat16).eps
    taps.register_norm(ForeignNorm, "rms", eps="my_eps", weight="scale")
    try:
        found = taps.find_norms(model)
        foreign = [f for f in found if f.name == "5"][0]
        assert foreign.kind == "rms" and foreign.eps() == 1e-4 and foreign.width == 8
        assert foreign.weight() is model[5].scale
    finally:
        taps.unregister_norm(ForeignNorm)
    assert "5" not in [f.name for f in taps.find_norms(model)]


def test_bad_declared_kind_and_registry_arguments():
    class Bad(nn.Module):
        lnmonitor_norm_kind = "batch"

    with pytest.raises(ValueError, match="lnmonitor_norm_kind"):
        taps.find_norms(nn.Sequential(Bad()))
    with pytest.raises(ValueError, match="kind"):
        taps.register_norm(ForeignNorm, "group")
    with pytest.raises(TypeError):
        taps.register_norm(int, "rms")


def test_select_by_glob():
    from lnmonitor.tiny.model import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(width=32, depth=3, heads=2, context=8))
    found = taps.find_norms(model)
    assert [f.name for f in found] == [
        "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2",
        "blocks.2.ln1", "blocks.2.ln2", "lnf",
    ]
    names = [f.name for f in taps.select_norms(found, include="*.ln1")]
    assert names == ["blocks.0.ln1", "blocks.1.ln1", "blocks.2.ln1"]
    names = [f.name for f in taps.select_norms(found, include=["blocks.*"], exclude="*ln2")]
    assert names == ["blocks.0.ln1", "blocks.1.ln1", "blocks.2.ln1"]
    assert taps.select_norms(found, include="nothing*") == []


# ---------------------------------------------------------------------------
# the hooks against float64
# ---------------------------------------------------------------------------



class Net(nn.Module):
    def __init__(self, d, kind, eps=1e-5):
        super().__init__()
        self.inp = nn.Linear(6, d)
        norm = nn.LayerNorm if kind == "layer" else nn.RMSNorm
        self.n1 = norm(d, eps=eps)
        self.mid = nn.Linear(d, d)
        self.n2 = norm(d, eps=eps)
        self.out = nn.Linear(d, 3)
        with torch.no_grad():
            for n in (self.n1, self.n2):
                n.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = self.inp(x) + 0.7
        h = h + self.mid(torch.nn.functional.gelu(self.n1(h)))
        return self.out(self.n2(3.0 * h))


def run_tap(model, x, dtype=None):
    norms = taps.find_norms(model)
    tap = taps.NormTap(norms)
    captured = {}
    handles = []
    for i, info in enumerate(norms):
        def hook(m, a, o, i=i):
            captured[i] = [a[0].detach()]
            o.register_hook(lambda g, i=i: captured[i].append(g.detach()))
        handles.append(info.module.register_forward_hook(hook))
    tap.attach()
    if dtype is None:
        loss = model(x).square().mean()
    else:
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x).square().mean()
    loss.backward()
    tap.detach()
    for h in handles:
        h.remove()
    return norms, tap.collect(), captured


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
        w = g * info.weight().detach().double().numpy()
        chunk = rows.data[:, start : start + count]
        start += count
        share, ok, var, ms, stat_ok = S.row_values(chunk, float(d), float(k == 2))
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
    norms = taps.find_norms(model)
    tap = taps.NormTap(norms)
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


def test_bfloat16_autocast_is_measured_in_float32():
    torch.manual_seed(0)
    model = Net(32, "layer")
    norms, rows, cap = run_tap(model, torch.randn(4, 6), dtype=torch.bfloat16)
    assert rows.data.dtype == torch.float32
    share, ok, *_ = S.row_values(rows.data, 32.0, 1.0)
    assert ok.all() and torch.isfinite(share).all()


def test_skipped_rows_zero_and_nonfinite():
    d = 16
    norm = nn.LayerNorm(d, elementwise_affine=False)
    info = taps.find_norms(nn.Sequential(norm))
    tap = taps.NormTap(info)
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
    layout = S.Layout(1)
    summary = S.read(S.merge(S.summarise(rows, layout, "cpu"), layout), layout)[0]
    assert summary.rows == 6
    assert summary.measured_rows == 4  # nan row and constant row have no sigma
    assert summary.share_rows == 3 and summary.skipped_rows == 3
    assert 0.0 <= summary.share_quantile(0.5) <= 1.0


def test_width_below_dead_dimension_raises_in_geometry_terms():
    info = taps.find_norms(nn.Sequential(nn.LayerNorm(2)))[0]
    assert info.width == 2 and info.dead_dim == 2


# ---------------------------------------------------------------------------
# summaries
# ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=300),
    st.sampled_from([0.1, 0.5, 0.9]),
)
def test_hist_quantile_within_one_bin(values, q):
    layout = S.Layout(1)
    v = np.asarray(values)
    counts = np.bincount(np.minimum((v * layout.share_bins).astype(int), layout.share_bins - 1),
                         minlength=layout.share_bins)
    est = S.hist_quantile(counts, layout.share_edges(), q, v.min(), v.max())
    assert abs(est - np.quantile(v, q)) <= S.SHARE_RESOLUTION + 1e-12


def test_log_quantile_relative_resolution():
    rng = np.random.default_rng(0)
    v = np.exp(rng.normal(0, 3, 5000))
    layout = S.Layout(1)
    idx = np.floor((np.log10(v) - layout.log_lo) * layout.per_decade).astype(int)
    counts = np.bincount(idx, minlength=layout.log_bins)
    for q in (0.1, 0.5, 0.9):
        est = S.hist_quantile(counts, layout.log_edges(), q, v.min(), v.max(), log=True)
        assert abs(est / np.quantile(v, q) - 1) <= S.VAR_RESOLUTION


def test_summaries_merge_like_one_batch():
    torch.manual_seed(1)
    model = Net(24, "layer")
    x = torch.randn(40, 6)
    layout = S.Layout(2)
    _, whole, _ = run_tap(model, x)
    model.zero_grad()
    # the two halves, each with its own loss (the share is per row and scale-free)
    _, a, _ = run_tap(model, x[:17])
    _, b, _ = run_tap(model, x[17:])
    one = S.merge(S.summarise(whole, layout, "cpu"), layout)
    two = S.merge(
        torch.stack([S.summarise(a, layout, "cpu"), S.summarise(b, layout, "cpu")]), layout
    )
    r1, r2 = S.read(one, layout), S.read(two, layout)
    for s1, s2 in zip(r1, r2, strict=True):
        assert s1.rows == s2.rows == 40
        assert abs(s1.share_max - s2.share_max) < 1e-6
        assert abs(s1.share_quantile(0.5) - s2.share_quantile(0.5)) <= 2 * S.SHARE_RESOLUTION
        assert abs(s1.var_quantile(0.5) / s2.var_quantile(0.5) - 1) <= 2 * S.VAR_RESOLUTION
        assert s1.var_min == s2.var_min and s1.var_max == s2.var_max


def test_empty_summary_reads_as_nan():
    layout = S.Layout(3)
    out = S.summarise(taps.StepRows(None, [], [], {}), layout, "cpu")
    s = S.read(S.merge(out, layout), layout)[1]
    assert s.rows == 0 and math.isnan(s.share_quantile(0.5)) and math.isnan(s.var_quantile(0.5))


def test_vectorised_quantiles_equal_the_reference():
    rng = np.random.default_rng(3)
    layout = S.Layout(1)
    share = rng.beta(1, 30, size=(4, 700)) ** 0.5
    counts = np.stack([np.bincount(np.minimum((r * 4096).astype(int), 4095), minlength=4096)
                       for r in share])
    counts[2] = 0  # an empty row reads as nan
    lo, hi = np.zeros(4), share.max(1)
    got = S.hist_quantiles(counts.astype(np.float32), layout.share_edges(), (0.5, 0.9, 0.01), lo, hi)
    for i in range(4):
        for j, q in enumerate((0.5, 0.9, 0.01)):
            ref = S.hist_quantile(counts[i], layout.share_edges(), q, lo[i], hi[i])
            if i == 2:
                assert math.isnan(got[i, j]) and math.isnan(ref)
            else:
                assert got[i, j] == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_layernorm_backward_path_matches_the_input_path():
    torch.manual_seed(5)
    x = 0.7 + 1.3 * torch.randn(300, 64)
    g = torch.randn(300, 64) * 1e-3
    ln = nn.LayerNorm(64, eps=1e-5)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    y = ln(x.requires_grad_())
    info = taps.find_norms(nn.Sequential(ln))[0]
    mean, rstd = taps._saved_stats(y, x, info)
    (dx,) = torch.autograd.grad(y, x, g)
    fast = taps.layernorm_backward_reductions(g, dx, mean, rstd, 1e-5, ln.weight)
    slow = taps.row_reductions(x, g, "layer", ln.weight)
    torch.testing.assert_close(fast[:4], slow[:4], rtol=2e-5, atol=0)
    s_fast = S.row_values(fast, 64.0, 1.0)[0]
    s_slow = S.row_values(slow, 64.0, 1.0)[0]
    torch.testing.assert_close(s_fast, s_slow, rtol=0, atol=2e-5)
    assert taps._saved_stats(nn.RMSNorm(64)(x), x, info) is None
