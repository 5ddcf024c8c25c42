"""Tests for lnmonitor.core.maths.random_baseline: the closed forms of the random share, their
types and the inputs they refuse, and seeded Monte Carlo of random directions (and of the shares
:func:`lnmonitor.core.maths.geometry.dead_plane_share` measures on random gradients)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, special

from lnmonitor.core.maths import geometry as G
from lnmonitor.core.maths import random_baseline as B

KINDS = ("layer", "rms")


def ks_gap(samples: np.ndarray, cdf) -> float:
    """Kolmogorov-Smirnov statistic of samples against a CDF callable on arrays."""
    s = np.sort(samples)
    n = s.size
    f = cdf(s)
    i = np.arange(1, n + 1)
    return float(max(np.max(i / n - f), np.max(f - (i - 1) / n)))


def random_shares(n, d, basis, rng, chunk=25_000):
    """Shares of n uniformly random directions in R^d onto the columns of an orthonormal basis,
    one array per leading-column count k = 1..basis.shape[1]."""
    k_max = basis.shape[1]
    out = [[] for _ in range(k_max)]
    for start in range(0, n, chunk):
        z = rng.standard_normal((min(chunk, n - start), d))
        znorm2 = np.einsum("ij,ij->i", z, z)
        proj2 = (z @ basis) ** 2
        cum = np.cumsum(proj2, axis=1)
        for k in range(k_max):
            out[k].append(np.sqrt(cum[:, k] / znorm2))
    return [np.concatenate(o) for o in out]


def test_baseline_design_figures():
    d = 128
    assert round(B.share_median(d), 4) == 0.1046
    assert B.share_median(d) == pytest.approx(math.sqrt(1 - 2 ** (-2 / (d - 2))), rel=1e-12)
    assert B.share_rms(d) == 0.125
    assert B.share_rms(d, 1) == pytest.approx(math.sqrt(1 / 128), rel=1e-15)
    n = 200_000
    m = B.max_share_median(d, 2, n)
    assert round(m, 3) == 0.425
    # k = 2 closed form: F(s) = 1 - (1 - s^2)^((d-2)/2), so F^n = 1/2 at
    # s^2 = 1 - (1 - 2^(-1/n))^(2/(d-2))
    tail = -math.expm1(-math.log(2) / n)
    assert m == pytest.approx(math.sqrt(1 - tail ** (2 / (d - 2))), rel=1e-10)


@pytest.mark.parametrize("d", (3, 10, 128, 4096))
def test_share_cdf_k2_closed_form(d):
    s = np.array([0.0, 1e-3, 0.05, 0.1046, 0.3, 0.7, 0.99, 1.0])
    np.testing.assert_allclose(B.share_cdf(s, d), 1 - (1 - s**2) ** ((d - 2) / 2),
                               rtol=1e-10, atol=1e-15)
    np.testing.assert_array_equal(B.share_cdf(np.array([-0.5, 1.5]), d), [0.0, 1.0])
    # k = 1: P(|z1|/|z| <= s) = I_{s^2}(1/2, (d-1)/2) -- compare to the t-distribution form
    from scipy import stats
    tt = s[1:-1] * math.sqrt(d - 1) / np.sqrt(1 - s[1:-1] ** 2)
    np.testing.assert_allclose(B.share_cdf(s[1:-1], d, 1), 2 * stats.t.cdf(tt, d - 1) - 1,
                               rtol=1e-9)
    # max over n rows, k = 2 closed form, F = -expm1(((d-2)/2) log1p(-s^2)) with no cancellation
    for n in (1, 50, 200_000):
        fn = np.exp(n * np.log(-np.expm1((d - 2) / 2 * np.log1p(-s[1:-1] ** 2))))
        np.testing.assert_allclose(B.max_share_cdf(s[1:-1], d, 2, n), fn, rtol=1e-9,
                                   atol=1e-300)


def test_baseline_scalar_and_array_types():
    assert isinstance(B.share_cdf(0.1, 128), float)
    assert isinstance(B.share_pdf(0.1, 128), float)
    assert isinstance(B.share_quantile(0.5, 128), float)
    assert isinstance(B.share_median(128), float)
    assert isinstance(B.max_share_cdf(0.3, 128, 2, 10), float)
    assert isinstance(B.max_share_quantile(0.5, 128, 2, 10), float)
    assert isinstance(B.max_share_median(128, 2, 10), float)
    q = np.array([0.1, 0.5, 0.9])
    assert B.share_quantile(q, 128).shape == (3,)
    assert B.max_share_quantile(q, 128, 1, 7).shape == (3,)
    # quantiles invert the CDFs
    np.testing.assert_allclose(B.share_cdf(B.share_quantile(q, 128, 1), 128, 1), q, rtol=1e-10)
    for n in (1, 50, 200_000):
        np.testing.assert_allclose(
            B.max_share_cdf(B.max_share_quantile(q, 128, 2, n), 128, 2, n), q, rtol=1e-9
        )
    # n = 1 is the single-row distribution
    np.testing.assert_allclose(B.max_share_quantile(q, 64, 2, 1), B.share_quantile(q, 64),
                               rtol=1e-12)


def test_max_share_quantile_keeps_precision_at_large_n():
    # k = 2 closed form: 1 - F(s) = (1 - s^2)^((d-2)/2), so the q-quantile of the max of n has
    # s^2 = -expm1(log(tail) * 2/(d-2)), tail = -expm1(log(q)/n).  The naive
    # beta.ppf(q ** (1/n)) is off by ~1e-7 relative at n = 1e12 because q**(1/n) rounds near 1.
    d = 128
    for n in (200_000, 10**9, 10**12):
        for q in (0.01, 0.5, 0.99):
            tail = -math.expm1(math.log(q) / n)
            exact = math.sqrt(-math.expm1(math.log(tail) * 2 / (d - 2)))
            assert B.max_share_quantile(q, d, 2, n) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("k", (1, 2, 3))
@pytest.mark.parametrize("d", (5, 16, 128))
def test_share_pdf_integrates_to_cdf(k, d):
    for a, b in ((0.0, 0.05), (0.05, 0.2), (0.2, 0.6), (0.0, 1.0)):
        val, _ = integrate.quad(lambda s: B.share_pdf(s, d, k), a, b, limit=200)
        assert val == pytest.approx(B.share_cdf(b, d, k) - B.share_cdf(a, d, k), abs=1e-9)
    s = np.array([0.03, 0.1, 0.4])
    h = 1e-6
    fd = (B.share_cdf(s + h, d, k) - B.share_cdf(s - h, d, k)) / (2 * h)
    np.testing.assert_allclose(B.share_pdf(s, d, k), fd, rtol=1e-5)
    assert B.share_pdf(-0.1, d, k) == 0.0 and B.share_pdf(1.1, d, k) == 0.0


def test_share_pdf_k1_at_zero_is_finite():
    d = 128
    # density of |z1|/|z| at 0: 2 / B(1/2, (d-1)/2)
    assert B.share_pdf(0.0, d, 1) == pytest.approx(2 / special.beta(0.5, (d - 1) / 2), rel=1e-12)
    assert B.share_pdf(0.0, d, 2) == 0.0


def test_the_meters_quantiles_equal_scipy_stats_bit_for_bit():
    # the meter's figures use scipy.special (light to import) where scipy.stats.beta's ppf and
    # isf call the same functions: nothing the monitors log may move by a bit
    from scipy import stats

    for k in (1, 2):
        for d in (*range(3, 300), 384, 512, 768, 1024, 2048, 4096, 12288):
            a, b = k / 2, (d - k) / 2
            assert B.share_median(d, k) == math.sqrt(stats.beta.ppf(0.5, a, b))
            for n in (1, 64, 1000, 200_000, 10**7):
                tail = -math.expm1(math.log(0.5) / n)
                assert B.max_share_median(d, k, n) == math.sqrt(stats.beta.isf(tail, a, b))


def test_baseline_validation():
    for bad in ((2, 2), (1, 2), (128, 0), (128.5, 2), (True, 1)):
        with pytest.raises(ValueError):
            B.share_cdf(0.1, *bad)
    with pytest.raises(ValueError, match="d must be > k"):
        B.share_median(2, 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        B.share_rms(128, 0)
    for q in (0.0, 1.0, -0.1, float("nan"), [0.5, 1.0]):
        with pytest.raises(ValueError, match="q must be"):
            B.share_quantile(q, 128)
        with pytest.raises(ValueError, match="q must be"):
            B.max_share_quantile(q, 128, 2, 10)
    for n in (0, -3, 2.5):
        with pytest.raises(ValueError, match="n must be"):
            B.max_share_median(128, 2, n)
    assert B.share_median(128.0, 2) == B.share_median(128, 2)  # integral floats accepted


def test_baseline_against_monte_carlo():
    # 200k uniformly random directions in R^128, projected on a fixed random 2-plane and on
    # one of its lines.
    d, n = 128, 200_000
    rng = np.random.default_rng(2024)
    basis, _ = np.linalg.qr(rng.standard_normal((d, 2)))
    s1, s2 = random_shares(n, d, basis, rng)
    gap2 = ks_gap(s2, lambda s: B.share_cdf(s, d, 2))
    gap1 = ks_gap(s1, lambda s: B.share_cdf(s, d, 1))
    assert gap2 < 0.01 and gap1 < 0.01
    # the check has power: the wrong k is far off
    assert ks_gap(s2, lambda s: B.share_cdf(s, d, 1)) > 0.1
    assert ks_gap(s2, lambda s: B.share_cdf(s, d - 16, 2)) > 0.02
    assert np.sqrt(np.mean(s2**2)) == pytest.approx(B.share_rms(d), rel=0.01)
    assert np.sqrt(np.mean(s1**2)) == pytest.approx(B.share_rms(d, 1), rel=0.01)
    assert np.median(s2) == pytest.approx(B.share_median(d), abs=0.002)


@pytest.mark.parametrize("kind", KINDS)
def test_dead_plane_share_of_random_gradients_follows_baseline(kind):
    # whole pipeline: random activation rows, isotropic gradients -> Beta(k/2, (d-k)/2)
    d, n = 128, 20_000
    gen = torch.Generator().manual_seed(31 if kind == "layer" else 32)
    x = 0.3 + torch.randn(n, d, generator=gen, dtype=torch.float64) * torch.rand(
        n, 1, generator=gen, dtype=torch.float64
    )
    gout = torch.randn(n, d, generator=gen, dtype=torch.float64)
    share, valid = G.dead_plane_share(x, gout, kind)
    assert valid.all()
    k = G.dead_dim(kind)
    assert ks_gap(share.numpy(), lambda s: B.share_cdf(s, d, k)) < 0.02
    assert ks_gap(share.numpy(), lambda s: B.share_cdf(s, d, 3 - k)) > 0.1


def test_max_share_against_monte_carlo():
    # maximum over n = 50 random rows, 5000 independent trials
    d, k, n, trials = 128, 2, 50, 5000
    rng = np.random.default_rng(77)
    basis, _ = np.linalg.qr(rng.standard_normal((d, k)))
    shares = random_shares(n * trials, d, basis, rng)[k - 1]
    maxima = shares.reshape(trials, n).max(axis=1)
    assert ks_gap(maxima, lambda s: B.max_share_cdf(s, d, k, n)) < 0.03
    for q in (0.1, 0.5, 0.9):
        s_q = B.max_share_quantile(q, d, k, n)
        assert np.mean(maxima <= s_q) == pytest.approx(q, abs=0.025)
    # and it is not the single-row quantile
    assert np.mean(maxima <= B.share_quantile(0.5, d, k)) < 0.01
