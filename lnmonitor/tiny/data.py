"""Character-level batches: the vocabulary of a text and reproducible windows of it."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lnmonitor.errors import UsageError

__all__ = ["CharDataModule", "CharVocab", "RandomWindows", "split_tokens", "windows_at"]


class CharVocab:
    """The sorted set of characters of a text; stored with checkpoints as a plain string."""

    def __init__(self, chars: str) -> None:
        if not chars or len(set(chars)) != len(chars):
            raise ValueError("a vocabulary is a non-empty string of distinct characters")
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self._index[c] for c in text], dtype=torch.long)
        except KeyError as err:
            raise UsageError(f"character {err.args[0]!r} is not in the model's vocabulary") from None

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def windows_at(tokens: torch.Tensor, offsets: torch.Tensor, context: int):
    """Inputs and next-character targets of the windows starting at ``offsets``."""
    index = offsets[:, None] + torch.arange(context + 1)
    chunk = tokens[index]
    return chunk[:, :-1], chunk[:, 1:]


class RandomWindows(IterableDataset):
    """Batches of random windows; batch ``i`` depends only on (seed, rank, i).  Iteration starts at batch
    ``start``, so a resumed fit continues the same stream; ``len`` is the number left."""

    def __init__(self, tokens: torch.Tensor, context: int, batch_size: int, seed: int, total: int,
                 start: int = 0, rank: int = 0) -> None:
        self.tokens, self.context, self.batch_size = tokens, context, batch_size
        self.seed, self.total, self.start, self.rank = seed, total, start, rank

    def __len__(self) -> int:
        return max(self.total - self.start, 0)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = (self.seed * 1_000_003 + self.rank) * 1_000_000_007 + index
        generator = torch.Generator().manual_seed(stream % 2**63)
        high = len(self.tokens) - self.context - 1
        offsets = torch.randint(0, high + 1, (self.batch_size,), generator=generator)
        return windows_at(self.tokens, offsets, self.context)

    def __iter__(self):
        for index in range(self.start, self.total):
            yield self.batch(index)


def _spread_order(n: int) -> torch.Tensor:
    """A permutation of ``range(n)`` whose every prefix is spread over the whole range: the indices sorted
    by the bit-reversal of their position (van der Corput)."""

    def radical_inverse(i: int) -> float:
        out, base = 0.0, 0.5
        while i:
            out += base * (i & 1)
            i, base = i >> 1, base / 2
        return out

    keys = [radical_inverse(i) for i in range(n)]
    return torch.tensor(sorted(range(n), key=keys.__getitem__))


class CharDataModule(L.LightningDataModule):
    """Character batches from ``text``, split 90/10 by position: random training windows drawn
    reproducibly from ``seed``, and up to ``val_windows`` evenly spaced windows of the held-out tail, the
    same for every seed."""

    def __init__(self, text: str, vocab: CharVocab | None = None, context: int = 64, batch_size: int = 32,
                 seed: int = 0, max_steps: int = 3000, val_fraction: float = 0.1,
                 val_windows: int = 512) -> None:
        super().__init__()
        # HPARAMS columns; context and max_steps are the module's (Lightning refuses a key both hold)
        self.save_hyperparameters("batch_size", "seed", "val_fraction", "val_windows")
        self.vocab = vocab or CharVocab.from_text(text)
        self.context, self.batch_size, self.seed = context, batch_size, seed
        self.max_steps, self.val_windows = max_steps, val_windows
        self.train_tokens, self.val_tokens = split_tokens(self.vocab.encode(text), val_fraction)
        shortest = min(len(self.train_tokens), len(self.val_tokens))
        if shortest <= context + 1:
            raise UsageError(f"the text is too short for context {context}: each split needs more than "
                             f"{context + 1} characters, the shorter has {shortest}; pass a longer text")

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches if trainer else 1
        start = trainer.global_step * accumulate if trainer else 0
        rank = trainer.global_rank if trainer else 0
        dataset = RandomWindows(self.train_tokens, self.context, self.batch_size, self.seed,
                                total=self.max_steps * accumulate, start=start, rank=rank)
        return DataLoader(dataset, batch_size=None)

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed held-out batches ``(inputs, targets)``: windows evenly spaced over the held-out text, in
        an order whose every prefix spreads over all of it (the first are the invariance probe's rows)."""
        high = len(self.val_tokens) - self.context - 1
        count = min(self.val_windows, high // self.context + 1)
        offsets = torch.linspace(0, high, count).long()[_spread_order(count)]
        inputs, targets = windows_at(self.val_tokens, offsets, self.context)
        return list(zip(inputs.split(self.batch_size), targets.split(self.batch_size), strict=True))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_batches(), batch_size=None)
