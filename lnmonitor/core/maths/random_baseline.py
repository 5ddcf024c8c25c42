"""The exact random baseline of the dead-plane share (docs/design.md).

For a direction uniform on the sphere in R^d and a fixed k-dimensional subspace (k = 2 for LayerNorm, 1 for
RMSNorm), ``share^2 ~ Beta(k/2, (d-k)/2)``, and the largest of n independent shares has
``P(max <= s) = F(s)^n``.  A measured median is compared with :func:`share_median`, a maximum over n rows with
:func:`max_share_median` of the same n.  Functions take numbers (or numpy arrays for ``s``/``q``) and return
floats (or arrays).  scipy loads on first use; the meter's two figures need only ``scipy.special`` (what
``scipy.stats.beta``'s ``ppf``/``isf`` call, bit for bit), not the slow-to-import ``scipy.stats``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["max_share_cdf", "max_share_median", "max_share_quantile", "share_cdf", "share_median",
           "share_pdf", "share_quantile", "share_rms"]


def _as_int(value, name: str, what: str) -> int:
    if not isinstance(value, bool) and (isinstance(value, numbers.Integral) or (
            isinstance(value, numbers.Real) and float(value).is_integer())):
        return int(value)
    raise ValueError(f"{name} must be an integer ({what}), got {value!r}")


def _check_dk(d, k) -> tuple[int, int]:
    d = _as_int(d, "d", "the row width")
    k = _as_int(k, "k", "the dead-subspace dimension: 2 for LayerNorm, 1 for RMSNorm")
    if k < 1:
        raise ValueError(f"k must be >= 1 (2 for LayerNorm, 1 for RMSNorm), got k={k}")
    if d <= k:
        raise ValueError(f"d must be > k (row width larger than the dead subspace), got d={d}, k={k}")
    return d, k


def _check_n(n) -> int:
    n = _as_int(n, "n", "the number of rows the maximum is taken over")
    if n < 1:
        raise ValueError(f"n must be >= 1 (the number of rows the maximum is over), got n={n}")
    return n


def _check_q(q) -> np.ndarray:
    qa = np.asarray(q, dtype=float)
    if not np.all((qa > 0.0) & (qa < 1.0)):
        raise ValueError(f"q must be a probability strictly between 0 and 1, got {q!r}")
    return qa


def _out(result, like):
    return float(result) if np.ndim(like) == 0 else np.asarray(result, dtype=float)


def _log_cdf(s: np.ndarray, d: int, k: int) -> np.ndarray:
    """log P(share <= s), accurate both in the lower tail and near 1."""
    a, b = k / 2.0, (d - k) / 2.0
    from scipy import stats
    s2 = np.clip(s, 0.0, 1.0) ** 2
    sf = stats.beta.sf(s2, a, b)
    with np.errstate(divide="ignore"):
        lo = stats.beta.logcdf(s2, a, b)
        hi = np.log1p(-sf)
    return np.where(sf < 0.5, hi, lo)


def share_cdf(s, d: int, k: int = 2):
    """P(share <= s) for a uniformly random direction in R^d and a fixed k-dim subspace."""
    d, k = _check_dk(d, k)
    from scipy import stats
    sa = np.asarray(s, dtype=float)
    res = stats.beta.cdf(np.clip(sa, 0.0, 1.0) ** 2, k / 2.0, (d - k) / 2.0)
    res = np.where(sa < 0.0, 0.0, res)
    return _out(res, s)


def share_pdf(s, d: int, k: int = 2):
    """Density of the share itself (not share^2): ``2 s * beta.pdf(s^2, k/2, (d-k)/2)``, 0 outside [0, 1]
    (evaluated in log space so k = 1 is finite at s = 0)."""
    from scipy import special
    d, k = _check_dk(d, k)
    a, b = k / 2.0, (d - k) / 2.0
    sa = np.asarray(s, dtype=float)
    inside = (sa >= 0.0) & (sa <= 1.0)
    sc = np.where(inside, sa, 0.5)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = (math.log(2.0) + special.xlogy(2.0 * a - 1.0, sc) + special.xlog1py(b - 1.0, -sc * sc)
                - special.betaln(a, b))
        res = np.where(inside, np.exp(logp), 0.0)
    return _out(res, s)


def share_quantile(q, d: int, k: int = 2):
    """Quantile of the random share: ``sqrt(beta.ppf(q, k/2, (d-k)/2))``, 0 < q < 1."""
    from scipy import special
    d, k = _check_dk(d, k)
    qa = _check_q(q)
    return _out(np.sqrt(special.betaincinv(k / 2.0, (d - k) / 2.0, qa)), q)


def share_median(d: int, k: int = 2) -> float:
    """Median share of a random direction (0.1046 at d = 128, k = 2)."""
    return share_quantile(0.5, d, k)


def share_rms(d: int, k: int = 2) -> float:
    """Root-mean-square share of a random direction: ``sqrt(k/d)`` (0.125 at d = 128, k = 2)."""
    d, k = _check_dk(d, k)
    return math.sqrt(k / d)


def max_share_cdf(s, d: int, k: int, n: int):
    """P(max of n independent random shares <= s) = ``F(s)^n``."""
    d, k = _check_dk(d, k)
    n = _check_n(n)
    sa = np.asarray(s, dtype=float)
    res = np.exp(n * _log_cdf(sa, d, k))
    res = np.where(sa < 0.0, 0.0, np.where(sa >= 1.0, 1.0, res))
    return _out(res, s)


def max_share_quantile(q, d: int, k: int, n: int):
    """Quantile of the max of n random shares: ``sqrt(beta.isf(-expm1(log(q)/n)))`` (the upper tail keeps
    full precision at large n)."""
    d, k = _check_dk(d, k)
    n = _check_n(n)
    qa = _check_q(q)
    from scipy import special
    tail = -np.expm1(np.log(qa) / n)
    return _out(np.sqrt(special.betainccinv(k / 2.0, (d - k) / 2.0, tail)), q)


def max_share_median(d: int, k: int, n: int) -> float:
    """Median of the max of n random shares (0.425 for d = 128, k = 2, n = 200,000)."""
    return max_share_quantile(0.5, d, k, n)
