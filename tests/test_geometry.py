"""Tests for lnmonitor.core.maths.geometry: closed forms pinned against autograd, float64 references
built independently (numpy/QR/SVD)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import qr_share
from hypothesis import given, settings
from hypothesis import strategies as st

from lnmonitor.core.maths import geometry as G

KINDS = ("layer", "rms")
EPSS = (0.0, 1e-5, 1e-1)
WIDTHS = (3, 4, 7, 16, 128)


# ---------------------------------------------------------------------------
# independent references
# ---------------------------------------------------------------------------


def ref_norm(x: torch.Tensor, eps: float, kind: str, g: torch.Tensor | None) -> torch.Tensor:
    """The norm itself: torch's layer_norm, or x / sqrt(mean(x^2) + eps) * g."""
    d = x.shape[-1]
    if kind == "layer":
        return F.layer_norm(x, (d,), weight=g, eps=eps)
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if g is None else y * g


def autograd_jac(x: torch.Tensor, eps: float, kind: str, g=None) -> torch.Tensor:
    """Per-row Jacobians of ref_norm from autograd, shape (rows, d, d)."""
    rows = x.reshape(-1, x.shape[-1])
    out = []
    for r in rows:
        out.append(
            torch.autograd.functional.jacobian(
                lambda v: ref_norm(v, eps, kind, g), r, vectorize=True
            )
        )
    return torch.stack(out)


def make_rows(n, d, seed, dtype=torch.float64, offset=0.7, scale=1.3):
    gen = torch.Generator().manual_seed(seed)
    return offset + scale * torch.randn(n, d, generator=gen, dtype=dtype)


def make_gain(d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed + 1000)
    return 1.0 + 0.5 * torch.randn(d, generator=gen, dtype=dtype)


# ---------------------------------------------------------------------------
# small pieces
# ---------------------------------------------------------------------------


def test_dead_dim():
    assert G.dead_dim("layer") == 2
    assert G.dead_dim("rms") == 1
    with pytest.raises(ValueError, match="layer"):
        G.dead_dim("batch")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", EPSS)
def test_normalise_against_numpy(kind, eps):
    x = make_rows(5, 33, seed=1).reshape(5, 1, 33)
    st_ = G.normalise(x, eps, kind)
    xn = x.numpy()
    if kind == "layer":
        mean = xn.mean(-1)
        var = xn.var(-1)  # biased (ddof=0)
        xc = xn - mean[..., None]
    else:
        mean = np.zeros(xn.shape[:-1])
        var = (xn**2).mean(-1)
        xc = xn
    sigma = np.sqrt(var + eps)
    assert st_.mean.shape == st_.var.shape == st_.sigma.shape == (5, 1)
    assert st_.xhat.shape == x.shape
    np.testing.assert_allclose(st_.mean.numpy(), mean, rtol=0, atol=1e-13)
    np.testing.assert_allclose(st_.var.numpy(), var, rtol=1e-13)
    np.testing.assert_allclose(st_.sigma.numpy(), sigma, rtol=1e-13)
    np.testing.assert_allclose(st_.xhat.numpy(), xc / sigma[..., None], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", (1e-5, 1e-1, 2.0))
def test_transmission_is_the_length_lost_by_xhat(kind, eps):
    # |xhat|^2 = d * var / (var + eps) = d * (1 - transmission)
    x = make_rows(6, 40, seed=2, scale=0.5)
    st_ = G.normalise(x, eps, kind)
    t = G.transmission(st_.var, eps)
    assert isinstance(t, torch.Tensor)
    np.testing.assert_allclose(
        (st_.xhat**2).sum(-1).numpy(), (40 * (1 - t)).numpy(), rtol=1e-12
    )
    # float and numpy inputs give the same numbers
    v = float(st_.var[0])
    assert isinstance(G.transmission(v, eps), float)
    assert G.transmission(v, eps) == pytest.approx(float(t[0]), rel=1e-14)
    np.testing.assert_allclose(G.transmission(st_.var.numpy(), eps), t.numpy(), rtol=1e-14)


def test_transmission_edge_cases():
    assert G.transmission(1.0, 0.0) == 0.0
    assert G.transmission(0.0, 1e-5) == 1.0
    assert math.isnan(G.transmission(0.0, 0.0))
    assert G.transmission(1.0, 1e-5) == pytest.approx(1e-5 / (1 + 1e-5), rel=1e-15)
    with pytest.raises(ValueError, match="eps"):
        G.transmission(1.0, -1e-5)


def test_deletion_cost():
    # docs/design.md: s = 0.105 costs ~0.55% of the length, not 10%
    assert G.deletion_cost(0.105) == pytest.approx(0.0055, abs=5e-5)
    assert G.deletion_cost(0.0) == 0.0
    assert G.deletion_cost(1.0) == 1.0
    # against the literal operation: delete the dead component of a unit vector
    rng = np.random.default_rng(3)
    u, v = np.linalg.qr(rng.standard_normal((50, 2)))[0].T
    for s in (0.01, 0.105, 0.5, 0.9, 0.999):
        w = s * u + math.sqrt(1 - s * s) * v
        kept = np.linalg.norm(w - (w @ u) * u)
        assert G.deletion_cost(s) == pytest.approx(1 - kept, rel=1e-9)
    # no cancellation for tiny shares (1 - sqrt(1 - 1e-18) is 0 in float64)
    assert G.deletion_cost(1e-9) == pytest.approx(0.5e-18, rel=1e-12)
    t = G.deletion_cost(torch.tensor([1e-9, 0.105, 0.5], dtype=torch.float64))
    assert isinstance(t, torch.Tensor)
    np.testing.assert_allclose(
        t.numpy(), [0.5e-18, G.deletion_cost(0.105), G.deletion_cost(0.5)], rtol=1e-12
    )
    np.testing.assert_allclose(G.deletion_cost(np.array([0.5])), [G.deletion_cost(0.5)])
    with pytest.raises(ValueError, match="share"):
        G.deletion_cost(1.5)


# ---------------------------------------------------------------------------
# Jacobian
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", EPSS)
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("gain", (False, True))
def test_jacobian_matches_autograd(kind, eps, d, gain):
    x = make_rows(2, d, seed=d).reshape(2, 1, d)
    g = make_gain(d, seed=d) if gain else None
    j = G.jacobian(x, eps, kind, weight=g)
    assert j.shape == (2, 1, d, d) and j.dtype == torch.float64
    ref = autograd_jac(x, eps, kind, g).reshape(2, 1, d, d)
    assert (j - ref).abs().max().item() < 1e-10


@settings(max_examples=30, deadline=None)
@given(
    d=st.integers(3, 64),
    kind=st.sampled_from(KINDS),
    eps=st.one_of(st.just(0.0), st.floats(1e-8, 1.0)),
    log_scale=st.floats(-2.0, 2.0),
    offset=st.floats(-3.0, 3.0),
    gain=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_jacobian_and_spectrum_property(d, kind, eps, log_scale, offset, gain, seed):
    scale = 10.0**log_scale
    x = make_rows(1, d, seed=seed, offset=offset * scale, scale=scale)
    g = make_gain(d, seed=seed) if gain else None
    ref = autograd_jac(x, eps, kind, g)
    mag = max(1.0, ref.abs().max().item())
    assert (G.jacobian(x, eps, kind, weight=g) - ref).abs().max().item() < 1e-10 * mag
    sv_ref = torch.linalg.svdvals(ref)
    sv = G.singular_values(x, eps, kind, weight=g)
    assert (sv - sv_ref).abs().max().item() < 1e-10 * mag


# ---------------------------------------------------------------------------
# singular values
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", EPSS)
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("gain", (False, True))
def test_singular_values_match_autograd_svd(kind, eps, d, gain):
    x = make_rows(2, d, seed=10 + d)
    g = make_gain(d, seed=d) if gain else None
    sv = G.singular_values(x, eps, kind, weight=g)
    ref = torch.linalg.svdvals(autograd_jac(x, eps, kind, g))
    assert sv.shape == (2, d)
    assert torch.all(sv[:, :-1] >= sv[:, 1:])  # descending
    assert (sv - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize("d", (5, 128))
def test_eps_singular_value_and_rank(d):
    x = make_rows(3, d, seed=20)
    xn = x.numpy()
    v = xn.var(-1)
    for eps in (1e-5, 1e-1, 1.0):
        sv_ref = torch.linalg.svdvals(autograd_jac(x, eps, "layer")).numpy()
        sigma = np.sqrt(v + eps)
        # d-2 values 1/sigma, one eps/((v+eps) sigma), one zero
        np.testing.assert_allclose(sv_ref[:, : d - 2], np.repeat(1 / sigma[:, None], d - 2, 1),
                                   rtol=1e-12)
        np.testing.assert_allclose(sv_ref[:, d - 2], eps / ((v + eps) * sigma), rtol=1e-9)
        assert np.all(sv_ref[:, d - 1] < 1e-12)
        # RMSNorm: the second moment plays the part of v
        ms = (xn**2).mean(-1)
        r = np.sqrt(ms + eps)
        sv_rms = torch.linalg.svdvals(autograd_jac(x, eps, "rms")).numpy()
        np.testing.assert_allclose(sv_rms[:, d - 1], eps / ((ms + eps) * r), rtol=1e-9)
    # eps = 0: exactly two zero singular values (rank d-2), the rest 1/sqrt(v)
    sv_ref = torch.linalg.svdvals(autograd_jac(x, 0.0, "layer")).numpy()
    tiny = sv_ref < 1e-12 * sv_ref[:, :1]
    assert np.all(tiny.sum(-1) == 2)
    np.testing.assert_allclose(sv_ref[:, : d - 2], np.repeat(1 / np.sqrt(v)[:, None], d - 2, 1),
                               rtol=1e-12)
    sv = G.singular_values(x, 0.0, "layer")
    assert torch.all(sv[:, -2:] == 0)
    assert torch.all(sv[:, :-2] > 0)
    assert torch.all(G.singular_values(x, 0.0, "rms")[:, -1] == 0)


def test_singular_values_batched_and_low_precision():
    x = make_rows(6, 9, seed=5).reshape(2, 3, 9)
    sv = G.singular_values(x, 1e-1, "layer")
    assert sv.shape == (2, 3, 9)
    flat = G.singular_values(x.reshape(6, 9), 1e-1, "layer")
    assert torch.equal(sv.reshape(6, 9), flat)
    g = make_gain(9, seed=5)
    svg = G.singular_values(x.to(torch.bfloat16), 1e-1, "rms", weight=g.to(torch.bfloat16))
    assert svg.dtype == torch.float32
    sv32 = G.singular_values(x.float(), 1e-1, "layer")
    assert sv32.dtype == torch.float32
    assert (sv32.double() - sv).abs().max().item() < 1e-5


def test_singular_values_layer_width_one_and_two():
    # d = 1: LayerNorm output is constant, J = 0; d = 2: one eps value and one zero
    x = torch.tensor([[0.3], [-2.0]], dtype=torch.float64)
    assert torch.equal(G.singular_values(x, 1e-1), torch.zeros(2, 1, dtype=torch.float64))
    x2 = make_rows(3, 2, seed=6)
    ref = torch.linalg.svdvals(autograd_jac(x2, 1e-1, "layer"))
    assert (G.singular_values(x2, 1e-1) - ref).abs().max().item() < 1e-10


# ---------------------------------------------------------------------------
# dead subspace
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", EPSS)
def test_dead_basis_is_orthonormal_and_dead(kind, eps):
    d = 24
    x = make_rows(4, d, seed=7)
    b = G.dead_basis(x, eps, kind)
    k = G.dead_dim(kind)
    assert b.shape == (4, d, k)
    eye = torch.eye(k, dtype=torch.float64)
    assert (b.transpose(-1, -2) @ b - eye).abs().max().item() < 1e-13
    j = autograd_jac(x, eps, kind)
    sigma = G.normalise(x, eps, kind).sigma
    t = G.transmission(G.normalise(x, eps, kind).var, eps)
    # J maps the scale direction to (eps/(v+eps))/sigma times itself; J 1 = 0 (layer)
    ju = j @ b
    expected_last = (t / sigma)[:, None] * b[..., -1]
    assert (ju[..., -1] - expected_last).abs().max().item() < 1e-12
    if kind == "layer":
        assert ju[..., 0].abs().max().item() < 1e-12
        # xhat / sqrt(d) is not unit length once eps > 0: |.|^2 = v/(v+eps)
        xhat = G.normalise(x, eps, kind).xhat
        naive = (xhat / math.sqrt(d)).norm(dim=-1) ** 2
        assert (naive - (1 - t)).abs().max().item() < 1e-12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gain", (False, True))
def test_share_against_qr_and_svd_references(kind, gain):
    d, n = 32, 8
    x = make_rows(n, d, seed=8)
    gen = torch.Generator().manual_seed(9)
    gout = torch.randn(n, d, generator=gen, dtype=torch.float64)
    g = make_gain(d, seed=8) if gain else None
    w = gout if g is None else g * gout
    share, valid = G.dead_plane_share(x, gout, kind, weight=g)
    assert valid.all()
    assert share.dtype == torch.float64
    # (a) explicit QR of [1, x - mean] / [x]
    ref = qr_share(x.numpy(), w.numpy(), kind)
    np.testing.assert_allclose(share.numpy(), ref, rtol=1e-12, atol=0)
    # (b) the dead subspace read off the autograd Jacobian: right singular vectors of its
    # k smallest singular values (eps = 0: its null space)
    k = G.dead_dim(kind)
    jac = autograd_jac(x, 0.0, kind)
    _, _, vh = torch.linalg.svd(jac)
    dead = vh[:, -k:, :]  # (n, k, d)
    p_w = (dead @ w.unsqueeze(-1)).squeeze(-1)
    ref_svd = p_w.norm(dim=-1) / w.norm(dim=-1)
    assert (share - ref_svd).abs().max().item() < 1e-10
    # and 1 - |P_perp w|^2 / |w|^2 with P_perp = I - V V^T
    perp = w - (dead.transpose(-1, -2) @ p_w.unsqueeze(-1)).squeeze(-1)
    ref_perp = 1 - perp.norm(dim=-1) ** 2 / w.norm(dim=-1) ** 2
    assert (share**2 - ref_perp).abs().max().item() < 1e-10


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eps", (0.0, 1e-1))
def test_backward_identity(kind, eps):
    # dL/dx = (1/sigma) (I - 11^T/d - xhat xhat^T/d) w, w = g * dL/dy.  At eps = 0 the matrix
    # is sigma^-1 (I - P), so |dL/dx| sigma = |w| sqrt(1 - share^2).  With eps > 0 the scale
    # direction leaks the transmission t: |dL/dx|^2 sigma^2 = |w|^2 (1 - share^2) + t^2 (w.u)^2.
    d, n = 48, 6
    x = make_rows(n, d, seed=11).requires_grad_(True)
    g = make_gain(d, seed=11)
    gen = torch.Generator().manual_seed(12)
    dy = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = ref_norm(x, eps, kind, g)
    (dx,) = torch.autograd.grad((y * dy).sum(), x)
    x = x.detach()
    w = g * dy
    share, valid = G.dead_plane_share(x, dy, kind, weight=g)
    assert valid.all()
    st_ = G.normalise(x, eps, kind)
    lhs = (dx.norm(dim=-1) * st_.sigma) ** 2
    rhs = w.norm(dim=-1) ** 2 * (1 - share**2)
    if eps > 0:
        u = G.dead_basis(x, eps, kind)[..., -1]
        t = G.transmission(st_.var, eps)
        rhs = rhs + (t * (w * u).sum(-1)) ** 2
    np.testing.assert_allclose(lhs.numpy(), rhs.numpy(), rtol=1e-10)
    # and, the other way round, the share is strictly below 1 and the gradient not zero
    assert torch.all(share < 1) and torch.all(dx.norm(dim=-1) > 0)


def test_share_batched_leading_dims():
    x = make_rows(12, 20, seed=13).reshape(3, 4, 20)
    gout = make_rows(12, 20, seed=14, offset=0.0).reshape(3, 4, 20)
    g = make_gain(20, seed=13)
    share, valid = G.dead_plane_share(x, gout, "layer", weight=g)
    assert share.shape == valid.shape == (3, 4)
    flat, _ = G.dead_plane_share(x.reshape(12, 20), gout.reshape(12, 20), "layer", weight=g)
    np.testing.assert_allclose(share.reshape(12).numpy(), flat.numpy(), rtol=1e-15)
    ref = qr_share(x.reshape(12, 20).numpy(), (g * gout).reshape(12, 20).numpy(), "layer")
    np.testing.assert_allclose(flat.numpy(), ref, rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_share_invalid_rows(kind):
    d = 16
    x = make_rows(8, d, seed=15)
    gout = make_rows(8, d, seed=16, offset=0.0)
    gout[0] = 0.0  # zero gradient
    x[1, 3] = float("nan")  # NaN activation
    gout[2, 5] = float("nan")  # NaN gradient
    gout[3, 0] = float("inf")  # inf gradient
    x[4, 2] = float("-inf")  # inf activation
    if kind == "layer":
        x[5] = 0.1  # constant row: xhat undefined
    else:
        x[5] = 0.0  # zero row: x/|x| undefined
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        share, valid = G.dead_plane_share(x.to(dtype), gout.to(dtype), kind)
        assert valid.tolist() == [False] * 6 + [True] * 2
        assert torch.isfinite(share).all()
        assert torch.all(share[:6] == 0)
        ref = qr_share(x[6:].to(dtype).double().numpy(), gout[6:].to(dtype).double().numpy(),
                       kind)
        np.testing.assert_allclose(share[6:].double().numpy(), ref, rtol=1e-5)
    # a zero gain makes w = 0 on every row
    share, valid = G.dead_plane_share(x, gout, kind, weight=torch.zeros(d, dtype=torch.float64))
    assert not valid.any() and torch.all(share == 0)


def test_share_constant_rows_with_offsets_float32():
    # mean() of a constant float32 row need not reproduce the constant; still invalid
    d = 100
    x = torch.empty(4, d, dtype=torch.float32)
    for i, c in enumerate((0.1, 1000.3, -7.77, 3.3e-7)):
        x[i] = c
    gout = torch.randn(4, d, generator=torch.Generator().manual_seed(0))
    share, valid = G.dead_plane_share(x, gout, "layer")
    assert not valid.any() and torch.all(share == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_share_float32_and_half_agree_with_float64(kind):
    d, n = 64, 200
    x = make_rows(n, d, seed=17)
    gout = make_rows(n, d, seed=18, offset=0.0)
    g = make_gain(d, seed=17)
    s64, v64 = G.dead_plane_share(x, gout, kind, weight=g)
    s32, v32 = G.dead_plane_share(x.float(), gout.float(), kind, weight=g.float())
    assert s32.dtype == torch.float32 and v32.dtype == torch.bool
    assert v64.all() and v32.all()
    assert (s32.double() - s64).abs().max().item() < 1e-5
    for low in (torch.float16, torch.bfloat16):
        xl, gl, wl = x.to(low), gout.to(low), g.to(low)
        sl, vl = G.dead_plane_share(xl, gl, kind, weight=wl)
        assert sl.dtype == torch.float32 and vl.all()
        # same (rounded) inputs in float64
        sr, _ = G.dead_plane_share(xl.double(), gl.double(), kind, weight=wl.double())
        assert (sl.double() - sr).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_share_extreme_scales_float32(kind):
    # gradients of 1e-30 (their squares underflow float32) and activations of 1e18 (their
    # squares overflow float32 sums) still give the float64 answer
    d, n = 64, 16
    x = make_rows(n, d, seed=19)
    gout = make_rows(n, d, seed=20, offset=0.0)
    ref = qr_share(x.numpy(), gout.numpy(), kind)
    for xs, gs in ((1.0, 1e-30), (1e18, 1.0), (1e-20, 1e25)):
        x32, g32 = (x * xs).float(), (gout * gs).float()
        share, valid = G.dead_plane_share(x32, g32, kind)
        assert valid.all()
        ref32 = qr_share(x32.double().numpy(), g32.double().numpy(), kind)
        np.testing.assert_allclose(share.double().numpy(), ref32, atol=2e-6)
        np.testing.assert_allclose(share.double().numpy(), ref, atol=2e-5)


@pytest.mark.parametrize("d", (64, 1024))
def test_share_float32_rows_with_large_offsets(d):
    # rows like 1000 + 0.01 * noise: float32 keeps the spread only if x - mean is taken in the
    # input's units and the rounding of the mean is removed; compare with float64 on the same
    # float32 values, for isotropic gradients and for gradients almost along 1
    gen = torch.Generator().manual_seed(d)
    for offset, spread in ((1000.0, 1e-2), (1.0, 1e-4)):
        x = (offset + spread * torch.randn(300, d, generator=gen, dtype=torch.float64)).float()
        g_iso = torch.randn(300, d, generator=gen)
        for gout in (g_iso, 1.0 + 0.01 * g_iso):
            share, valid = G.dead_plane_share(x, gout, "layer")
            assert valid.all()
            ref = qr_share(x.double().numpy(), gout.double().numpy(), "layer")
            np.testing.assert_allclose(share.double().numpy(), ref, atol=1e-6)


def test_share_shape_errors():
    x = make_rows(3, 2, seed=0)
    with pytest.raises(ValueError, match="d > 2"):
        G.dead_plane_share(x, x, "layer")
    assert G.dead_plane_share(x, x, "rms")[1].shape == (3,)
    with pytest.raises(ValueError, match="d > 1"):
        G.dead_plane_share(x[:, :1], x[:, :1], "rms")
    x = make_rows(3, 5, seed=0)
    with pytest.raises(ValueError, match="shape"):
        G.dead_plane_share(x, x[:2], "layer")
    with pytest.raises(ValueError, match="weight"):
        G.dead_plane_share(x, x, "layer", weight=torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="kind"):
        G.dead_plane_share(x, x, "group")
    with pytest.raises(ValueError, match="eps"):
        G.jacobian(x, -1.0)


def test_share_does_not_track_gradients():
    x = make_rows(3, 8, seed=1).requires_grad_(True)
    share, _ = G.dead_plane_share(x, torch.ones_like(x) + x, "layer")
    assert not share.requires_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_matches_cpu():
    x = make_rows(10, 32, seed=2)
    gout = make_rows(10, 32, seed=3, offset=0.0)
    g = make_gain(32, seed=2)
    xc, gc, wc = x.cuda(), gout.cuda(), g.cuda()
    s, v = G.dead_plane_share(xc, gc, "layer", weight=wc)
    assert s.device.type == "cuda" and v.all()
    s_cpu, _ = G.dead_plane_share(x, gout, "layer", weight=g)
    np.testing.assert_allclose(s.cpu().numpy(), s_cpu.numpy(), rtol=1e-12)
    for kind in KINDS:
        assert (G.jacobian(xc, 1e-5, kind, g.cuda()).cpu()
                - G.jacobian(x, 1e-5, kind, g)).abs().max().item() < 1e-12
        assert (G.singular_values(xc, 1e-1, kind).cpu()
                - G.singular_values(x, 1e-1, kind)).abs().max().item() < 1e-12
        assert G.dead_basis(xc, 1e-5, kind).device.type == "cuda"
