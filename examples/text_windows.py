"""Training and validation windows of real text for the examples, with nothing to download:
the Python help text every CPython carries, as bytes (a vocabulary of 256)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from lnmonitor.tiny.corpus import load_corpus

VOCAB = 256


def loaders(context: int = 64, batch_size: int = 16, windows: int = 4096, seed: int = 0):
    """``(train, val)`` DataLoaders of ``(x, y)`` windows, y the next byte of x; the
    validation windows come from the held-out last 10% of the text."""
    data = torch.frombuffer(bytearray(load_corpus().encode("utf-8")), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    g = torch.Generator().manual_seed(seed)

    def windows_of(part: torch.Tensor, n: int) -> TensorDataset:
        starts = torch.randint(0, len(part) - context - 1, (n,), generator=g)
        chunk = part[starts[:, None] + torch.arange(context + 1)]
        return TensorDataset(chunk[:, :-1], chunk[:, 1:])

    train = DataLoader(windows_of(data[:cut], windows), batch_size=batch_size, shuffle=True, generator=g)
    val = DataLoader(windows_of(data[cut:], 8 * batch_size), batch_size=batch_size)
    return train, val
