"""The probe rows (:mod:`lnmonitor.core.invariance.probe_rows`): batches padded to different lengths
joined exactly as the collator pads all their rows at once, on either side; what cannot be
joined said once by name; any mapping is keyword inputs; and the Lightning callback measuring on
padded validation batches of different lengths (it turned itself off, blaming loss_fn=).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import fit  # noqa: E402
from test_transformers_callback import PAD, llama, records, tokenizer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lnmonitor import FinalNormInvarianceMonitor  # noqa: E402
from lnmonitor.core.invariance.loss_contract import default_loss  # noqa: E402
from lnmonitor.core.invariance.probe_rows import Padding, first_samples, pad_id_of  # noqa: E402


def _collated(tok, rows: list[dict], batch: int) -> DataLoader:
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    return DataLoader(rows, batch_size=batch, collate_fn=collator)


@pytest.mark.parametrize("side", ["right", "left"])
def test_joined_rows_equal_the_collators_padding_of_all_rows_at_once(side):
    """Four batches of 8, each padded to its own longest, joined: exactly what the collator
    gives for the 32 rows in one batch (padded to the longest of all, on the tokenizer's side)."""
    tok = tokenizer(side)
    rows = records(tok, 32, 2)
    said: list[str] = []
    joined = first_samples(_collated(tok, rows, 8), 32, pad=pad_id_of(None, tok), info=said.append,
                           warn=pytest.fail)
    whole = next(iter(_collated(tok, rows, 32)))
    assert len({len(r["input_ids"]) for r in rows}) > 1 and joined.keys() == whole.keys()
    for key in whole:
        assert torch.equal(joined[key], whole[key]), key
    assert len(said) == 1 and f"input_ids with {PAD} (the tokenizer's pad_token_id)" in said[0]


def test_the_pad_id_comes_from_the_tokenizer_else_the_model_config_else_zero_said():
    assert pad_id_of(llama(), tokenizer()) == Padding(PAD, "the tokenizer's pad_token_id")
    assert pad_id_of(llama(pad_token_id=7)) == Padding(7, "the model config's pad_token_id")
    zero = pad_id_of(llama(pad_token_id=None))
    assert zero.id == 0 and "neither the tokenizer nor the model config" in zero.source


def test_a_batch_that_cannot_be_joined_is_said_once_by_name_and_the_rows_before_are_kept():
    ids = [torch.ones(2, n, dtype=torch.long) for n in (3, 3, 5)]
    extra = [{"input_ids": i, "attention_mask": torch.ones_like(i), "span": torch.zeros_like(i)} for i in ids]
    said: list[str] = []
    rows = first_samples(iter(extra), 6, warn=said.append)
    assert len(said) == 1 and "batch 3" in said[0] and "'span'" in said[0] and "first 2 batch(es)" in said[0]
    assert rows["input_ids"].shape == (4, 3)
    texts = [{"input_ids": i, "text": [f"row {b}.{k}" for k in (0, 1)]} for b, i in enumerate(ids[:2])]
    said.clear()
    rows = first_samples(iter(texts), 4, warn=said.append)
    assert len(said) == 1 and "'text[0]' holds a str" in said[0] and rows is texts[0]
    unmasked = [{"input_ids": i} for i in ids[1:]]
    said.clear()
    rows = first_samples(iter(unmasked), 4, warn=said.append)
    assert len(said) == 1 and "no attention_mask marks the padding" in said[0] and rows is unmasked[0]


def test_a_loader_that_raises_is_said_and_the_rows_read_are_kept():
    def loader():
        yield torch.ones(2, 3)
        raise OSError("shard missing")

    said: list[str] = []
    rows = first_samples(loader(), 8, warn=said.append)
    assert rows.shape == (2, 3) and len(said) == 1 and "OSError: shard missing" in said[0]


def test_any_mapping_is_keyword_inputs():
    tok = tokenizer()
    batch = next(iter(_collated(tok, records(tok, 4, 3), 4)))
    assert isinstance(batch, transformers.BatchEncoding) and not isinstance(batch, dict)
    out = default_loss(llama(), batch)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)


class LitLlama(L.LightningModule):
    """A Lightning fine-tune of the tiny Llama on collated batches (no forward of its own)."""

    def __init__(self):
        super().__init__()
        self.model = llama()

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_lightning_callback_measures_on_padded_validation_batches_of_different_lengths():
    tok = tokenizer()
    train, val = _collated(tok, records(tok, 16, 0), 4), _collated(tok, records(tok, 32, 1), 8)
    monitor = FinalNormInvarianceMonitor(invariance_every_n_steps=2, probe_size=32, summary=False,
                                         keep_history=True)
    _, said = fit(LitLlama(), train, [monitor], 2, val=val)
    assert monitor.off_reason is None, monitor.off_reason
    assert not [s for s in said if "FinalNormInvarianceMonitor" in s and "off" in s], said
    assert [h["step"] for h in monitor.history if "lnmonitor/invariance/scale_3/dloss" in h] == [0, 2]
    rows = monitor._probe
    assert rows["input_ids"].shape[0] == 32 and len({len(r["input_ids"]) for r in records(tok, 32, 1)}) > 1
    pads = rows["attention_mask"] == 0
    assert pads.any() and (rows["input_ids"][pads] == PAD).all() and (rows["labels"][pads] == -100).all()
