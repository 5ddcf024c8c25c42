"""Independent float64 references shared by the tests (numpy only, no lnmonitor code)."""

import numpy as np


def qr_share(x: np.ndarray, w: np.ndarray, kind: str = "layer") -> np.ndarray:
    """Dead-plane share per row: ``|Q^T w| / |w|`` with Q from an explicit QR of
    ``[1, x - mean]`` (LayerNorm) or ``[x]`` (RMSNorm)."""
    out = []
    for xr, wr in zip(x, w, strict=True):
        if kind == "layer":
            a = np.stack([np.ones_like(xr), xr - xr.mean()], axis=1)
        else:
            a = xr[:, None]
        q, _ = np.linalg.qr(a)
        out.append(np.linalg.norm(q.T @ wr) / np.linalg.norm(wr))
    return np.array(out)
