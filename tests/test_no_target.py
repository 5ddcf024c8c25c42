"""A position without a target is no fault, through all three integrations (issue 44).

Instruction tuning gives the prompt's labels -100, packing its separators, a collator its padding;
a causal LM's last token has no target either.  Such a position has no gradient at the final norm
(its row's gradient comes from its own position's loss alone), and none at the norms before it
when no later position has a target.  Those rows are ``zero_grad_rows``, said once as such, and
never ``vanished_grad_rows``, the fault (tests/test_growth_watch.py has the fault itself: rows
without gradient where the final norm's row has one)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lightning as L  # noqa: E402

from lnmonitor import LayerNormMonitor  # noqa: E402
from lnmonitor.integrations.loop import LoopMonitor  # noqa: E402
from lnmonitor.integrations.transformers import LNMonitorCallback  # noqa: E402

ROWS, CONTEXT, HALF, STEPS = 4, 16, 8, 2
FAULT = "a gradient that vanished, a fault"


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batch() -> dict[str, torch.Tensor]:
    """Sequences whose second half has no target: the reply masked out (a packing separator and
    everything after it)."""
    x = torch.randint(0, 64, (ROWS, CONTEXT), generator=torch.Generator().manual_seed(1))
    labels = x.clone()
    labels[:, HALF:] = -100
    return {"input_ids": x, "labels": labels}


# with the labels shifted inside the model, positions HALF - 1 .. CONTEXT - 1 have no target, and no
# position after them has one: no norm has a gradient there
NO_TARGET = ROWS * (CONTEXT - HALF + 1)


def _faults(said: list[str]) -> list[str]:
    return [s for s in said if FAULT in s]


def _check(history: list[dict], names: list[str]) -> None:
    assert history and all("lnmonitor/ladder/growth" in h for h in history)
    for h in history:
        for name in names:
            assert h[f"lnmonitor/vanished_grad_rows/{name}"] == 0, (h["step"], name)
            assert h[f"lnmonitor/zero_grad_rows/{name}"] == NO_TARGET, (h["step"], name)
            assert h[f"lnmonitor/skipped_rows/{name}"] == 0, (h["step"], name)


class Masked(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt2()

    def training_step(self, b, batch_idx):
        return self.model(**b).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_the_lightning_callback_counts_masked_labels_as_no_target():
    monitor = LayerNormMonitor(every_n_steps=1, images=False, summary=False, keep_history=True)
    data = [{k: v[i] for k, v in batch().items()} for i in range(ROWS)]
    trainer = L.Trainer(max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[monitor], accelerator="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Masked(), torch.utils.data.DataLoader(data, batch_size=ROWS))
    assert not _faults([str(w.message) for w in caught])
    _check(monitor.history, [n.name for n in monitor.norms])


def test_the_loop_monitor_counts_masked_labels_as_no_target():
    model = gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = LoopMonitor(model, every_n_steps=1, invariance_every_n_steps=None, keep_history=True,
                          images=False, summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            with monitor.step(step):
                model(**batch()).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert not _faults([str(w.message) for w in caught])
    _check(monitor.history, [n.name for n in monitor.meter.norms])


WORDS = [f"w{i}" for i in range(30)]
TEMPLATE = "###"  # the response template a completion-only collator looks for


def completion_only(tok):
    """What trl's ``DataCollatorForCompletionOnlyLM`` does: pad each batch to its longest
    sequence, and give -100 to every label up to and including the response template, and to
    the padding."""
    template = tok.convert_tokens_to_ids(TEMPLATE)

    def collate(features):
        out = tok.pad(features, return_tensors="pt")
        labels = out["input_ids"].clone()
        for row, ids in enumerate(out["input_ids"].tolist()):
            labels[row, : ids.index(template) + 1] = -100
        labels[out["attention_mask"] == 0] = -100
        out["labels"] = labels
        return out

    return collate


def test_the_trainer_callback_counts_a_completion_only_collators_prompts_as_no_target(tmp_path):
    """Padded batches of different lengths whose prompts have no target (the prompt, the
    template): the prompt's positions feed the reply through attention, so only the norms after
    the last attention lack their gradient there, and no row is a fault."""
    import tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, TEMPLATE: 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    model_ = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model_.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=model_, pad_token="[PAD]", unk_token="[UNK]")
    rng = random.Random(0)

    def text():
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10)))
        return f"{prompt} {TEMPLATE} {reply}"

    records = [dict(tok(text())) for _ in range(32)]
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, pad_token_id=1)
    torch.manual_seed(0)
    callback = LNMonitorCallback(every_n_steps=1, invariance_every_n_steps=None, keep_history=True,
                                 images=False, summary=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-3, logging_steps=1,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args,
                                   train_dataset=records,
                                   data_collator=completion_only(tok), callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not _faults([str(w.message) for w in caught])
    assert [h["step"] for h in callback.history] == [1, 2, 3]
    final, first = "model.norm", "model.layers.0.input_layernorm"
    for h in callback.history:
        assert all(v == 0 for t, v in h.items() if t.startswith("lnmonitor/vanished_grad_rows/")), h["step"]
        # every prompt position (and each sequence's last) lacks a target; before the last attention
        # a prompt position reaches the reply's targets, after it not
        assert h[f"lnmonitor/zero_grad_rows/{final}"] >= 4 * 4
        assert h[f"lnmonitor/zero_grad_rows/{first}"] == 4
