"""Which rows of a batch are padding, so that no forward statistic (sigma, rms, eps/var) counts them.

The mask is a mapping batch's ``attention_mask`` (an encoder-decoder's decoder: ``decoder_attention_mask``).
``labels == -100`` is not padding (a real token without a target); padding only the labels mark needs
``row_mask``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lnmonitor.core.meter.messages import decoder_padding_message, row_mask_message

__all__ = ["RowMasks", "padding_mask"]


def padding_mask(batch, key: str = "attention_mask") -> tuple[Tensor, str] | None:
    """``(keep, source)``: a bool tensor, True on the real tokens, and where it came from; None when the
    batch is not a mapping or has no 2-D integer ``batch[key]``."""
    mask = batch.get(key) if isinstance(batch, Mapping) else None
    if isinstance(mask, Tensor) and mask.ndim == 2 and not mask.is_floating_point():
        return mask != 0, f"the batch's {key}"
    return None


class RowMasks:
    """The rows a meter measures in a (micro-)batch: ``mask(batch)`` is one bool mask for every norm, or (an
    encoder-decoder, its padding taken from the batch) ``{norm index: mask}``, or None (every row counts).

    ``row_mask``: the user's ``row_mask(batch)``, False (every row counts) or None (:func:`padding_mask`);
    ``decoder``: the indices of the decoder's norms; ``device()``: where the masks go.  A ``row_mask`` that
    raises is said once through ``warn`` and turned off; :attr:`source` says where the last mask came from."""

    def __init__(self, row_mask: Callable | bool | None, decoder: set[int], n_norms: int,
                 device: Callable[[], torch.device], name: str, warn: Callable[[str, str], None]) -> None:
        self.row_mask = row_mask
        self.source: str | None = None
        self._decoder, self._n, self._device, self._name, self._warn = decoder, n_norms, device, name, warn

    def __call__(self, batch) -> Tensor | dict[int, Tensor | None] | None:
        try:
            if callable(self.row_mask):
                return self._as_rows(self.row_mask(batch), "row_mask")
            keep = self._as_rows(*(padding_mask(batch) or (None, None)))
            if not self._decoder:
                return keep
            decoder = self._as_rows(*(padding_mask(batch, "decoder_attention_mask") or (None, None)))
            if keep is None and decoder is None:
                return None
            if decoder is None:
                self._warn("decoder-padding", decoder_padding_message(self._name))
            return {i: decoder if i in self._decoder else keep for i in range(self._n)}
        except Exception as err:  # noqa: BLE001 - the user's row_mask must not stop training
            self.row_mask = False
            self._warn("row-mask", row_mask_message(self._name, err))
            return None

    def _as_rows(self, keep, source: str | None) -> Tensor | None:
        if keep is None:
            return None
        self.source = source
        keep = torch.as_tensor(keep).to(self._device(), non_blocking=True).bool()
        return keep if keep.ndim == 2 else keep.reshape(-1)  # (batch, tokens) lines up with per-head rows
