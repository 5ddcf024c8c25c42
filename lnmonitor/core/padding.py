"""Which rows of a batch are padding, so that no statistic counts them.

A padded batch's pad positions carry no gradient (the shares skip them anyway) but they do
run through every norm, and their forward statistics (sigma, rms, eps/var) would bias the
real tokens' -- by half at 50% padding when the pad embedding is zero.  :func:`padding_mask`
finds the mask where the ecosystem puts it: a mapping batch's ``attention_mask`` (1 for a
real token, 0 for padding; a 2-D integer or bool tensor).  An encoder-decoder's decoder
reads other tokens: its mask is ``decoder_attention_mask``, and ``attention_mask`` (the
encoder's) says nothing of them.

``labels == -100`` is not taken for padding: ``-100`` marks a position without a target
(the prompt of an instruction-tuning example, a sequence's first token), which is a real
token the model reads; a batch whose padding only its labels mark needs ``row_mask``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

__all__ = ["padding_mask"]


def padding_mask(batch, key: str = "attention_mask") -> tuple[Tensor, str] | None:
    """``(keep, source)``: a bool tensor, True on the real tokens, and where it came from;
    None when the batch says nothing about padding (not a mapping, or no 2-D integer
    ``batch[key]``; ``key="decoder_attention_mask"`` for a decoder's tokens)."""
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get(key)
    if isinstance(mask, Tensor) and mask.ndim == 2 and not mask.is_floating_point():
        return mask != 0, f"the batch's {key}"
    return None
