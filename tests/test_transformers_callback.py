"""The transformers.Trainer callback as a fine-tuning script uses it: ``Trainer(...,
trainer.add_callback(LNMonitorCallback(trainer))``, a tiny random Llama, sequences of different lengths
padded per batch by ``DataCollatorForLanguageModeling(mlm=False)`` with a tokenizer built
here (``tokenizers``' WordLevel, pad id 1: nothing downloaded), the Trainer's default eval
batch size (8), TensorBoard as its ``report_to``.  The probe rows' joining itself:
tests/test_probe_rows.py.
"""

from __future__ import annotations

import random
import re
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from conftest import events  # noqa: E402

from lnmonitor.integrations.transformers import LNMonitorCallback  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
PAD, STEPS, LOGGING = 1, 12, 5


def tokenizer(side: str = "right") -> transformers.PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[PAD]": PAD, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                padding_side=side)


def records(tok, n: int, seed: int) -> list[dict]:
    """``n`` tokenized texts of 4 to 40 words, unpadded."""
    rng = random.Random(seed)
    return [dict(tok(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))))) for _ in range(n)]


def llama(pad_token_id: int | None = PAD) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=len(WORDS) + 2, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, pad_token_id=pad_token_id)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def training_args(out: Path, **kw) -> transformers.TrainingArguments:
    settings = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                    logging_steps=LOGGING, save_strategy="no", report_to=["tensorboard"], use_cpu=True,
                    disable_tqdm=True, learning_rate=1e-3, dataloader_num_workers=0)
    return transformers.TrainingArguments(**{**settings, **kw})


def scalar_steps(folder: Path) -> dict[str, list[int]]:
    acc = events(folder)
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def fine_tune(tmp_path_factory):
    """One fine-tune, as a user writes it; what it logged and said."""
    out = tmp_path_factory.mktemp("trainer")
    tok = tokenizer()
    trainer = transformers.Trainer(
        model=llama(), args=training_args(out), train_dataset=records(tok, 64, 0),
        eval_dataset=records(tok, 64, 1), processing_class=tok,
        data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=False),
    )
    callback = LNMonitorCallback(trainer, invariance_every_n_steps=10)
    trainer.add_callback(callback)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    files = sorted(out.rglob("events.out.tfevents.*"))
    return callback, files, [str(w.message) for w in said]


def test_padded_eval_batches_are_joined_and_the_probe_measures(fine_tune):
    """64 probe rows from 8 eval batches of 8 at different padded lengths (concatenating them
    crashed ``trainer.train()``), through ``model(**batch)`` for the collator's BatchEncoding
    (``model(batch)`` turned the probe off)."""
    callback, files, said = fine_tune
    assert callback.invariance_off_reason is None, callback.invariance_off_reason
    assert not [s for s in said if "probe" in s], said
    rows = callback._runs.batch
    assert isinstance(rows, transformers.BatchEncoding) and rows["input_ids"].shape[0] == 64
    pads = rows["attention_mask"] == 0
    assert pads.any() and (rows["input_ids"][pads] == PAD).all() and (rows["labels"][pads] == -100).all()
    curves = scalar_steps(files[0].parent)
    assert curves["train/lnmonitor/invariance/scale_3/dloss"] == [10, STEPS]
    acc = events(files[0].parent)
    dloss = {case: [abs(e.value) for e in acc.Scalars(f"train/lnmonitor/invariance/{case}/dloss")]
             for case in ("scale_3", "axis_5", "shift_5")}
    # Llama's final norm is an RMSNorm: a scale leaves the loss (up to eps/v, ~1e-3 at this
    # random init: |dloss| ~3e-6), a shift moves it as the control does (~2e-2, ~3e-3)
    assert max(dloss["scale_3"]) < 1e-4 < min(dloss["axis_5"] + dloss["shift_5"])


def test_points_land_on_the_trainers_logging_steps_in_one_event_file(fine_tune):
    """The ladder at the fit's first step (1: the model before any update, the start the findings
    judge from), the steps the Trainer logs its loss (5, 10) and the last (12), not 6 or 11; the
    end-of-run point in the same event file as the Trainer's own end-of-run metrics."""
    callback, files, _ = fine_tune
    assert len(files) == 1, files
    curves = scalar_steps(files[0].parent)
    assert curves["train/loss"] == [5, 10]
    assert curves["train/lnmonitor/ladder/attenuation"] == [1, 5, 10, STEPS]
    assert curves["train/lnmonitor/sigma/model.norm"] == [1, 5, 10, STEPS]
    assert curves["train/train_loss"] == [STEPS]
    assert curves["train/lnmonitor/invariance/scale_3/out_residual"][-1] == STEPS


def test_the_custom_scalars_layout_names_the_trainers_tags(fine_tune):
    from tensorboard.plugins.custom_scalar import layout_pb2

    _, files, said = fine_tune
    acc = events(files[0].parent)
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == [
        "lnmonitor: 1/sigma ladder", "lnmonitor: dead-plane share", "lnmonitor: final-norm invariance"]
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["1/sigma by norm"] == ["train/lnmonitor/inv_sigma/.*"]
    # every chart draws something of this run, but the sweep's fit, which this run has not (the
    # reason is kept, and noted on the lnmonitor logger: not a warning, there is nothing to do)
    callback = fine_tune[0]
    assert callback._runs.last.fit_note.startswith("no fit")
    assert not [s for s in said if "no scale-sweep slope" in s]
    tags = set(acc.Tags()["scalars"])
    for title, patterns in charts.items():
        drawn = any(re.match(p, t) for p in patterns for t in tags)
        assert drawn or title == "scale sweep: slope and constant", title


def test_summarize_reads_a_trainer_run(fine_tune, capsys):
    from lnmonitor.commands.cli import main

    _, files, _ = fine_tune
    assert main(["summarize", str(files[0].parent), "--no-figures"]) == 0
    text = capsys.readouterr().out
    assert "no lnmonitor metric" not in text
    assert "the ladder at step 12 (4 measured steps, the first at 1" in text
    assert "layers.0.input_layernorm" in text and "final-norm invariance at step 12" in text


class OwnLossTrainer(transformers.Trainer):
    """A Trainer whose loss is its own: the collator gives no labels."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs, labels=inputs["input_ids"])
        return (out.loss, out) if return_outputs else out.loss


def test_a_collator_output_without_labels_turns_the_probe_off_once_by_name(tmp_path):
    tok = tokenizer()
    callback = LNMonitorCallback(invariance_every_n_steps=5, keep_history=True)
    trainer = OwnLossTrainer(
        model=llama(), args=training_args(tmp_path, max_steps=6, report_to=[]),
        train_dataset=records(tok, 32, 0),
        eval_dataset=records(tok, 16, 1), data_collator=transformers.DataCollatorWithPadding(tok),
        processing_class=tok, callbacks=[callback],
    )
    with pytest.warns(UserWarning) as said:
        trainer.train()
    off = [str(w.message) for w in said if "invariance probe is off" in str(w.message)]
    assert len(off) == 1 and "no 'labels' (their keys: input_ids, attention_mask)" in off[0], off
    assert "final_norm" not in off[0]
    assert [h["step"] for h in callback.history] == [1, 5, 6]  # the ladder goes on


def test_without_its_trainer_it_says_so_and_keeps_history(tmp_path):
    """A callback not handed its Trainer reaches no report_to integration: said once."""
    args = training_args(tmp_path)
    state = transformers.TrainerState(max_steps=4, is_world_process_zero=True)
    callback = LNMonitorCallback(invariance_every_n_steps=None)
    with pytest.warns(UserWarning, match="no transformers.Trainer was handed to it"):
        callback.on_train_begin(args, state, transformers.TrainerControl(), model=llama())
    callback._report({"lnmonitor/x": 1.0}, args, state, transformers.TrainerControl())
    assert callback._reporters == [] and callback.history == [{"step": 0, "lnmonitor/x": 1.0}]


def test_a_wrong_trainer_argument_is_refused_by_name():
    from lnmonitor.core.monitor.arguments import ArgumentError

    with pytest.raises(ArgumentError, match=r"pass the settings by name"):
        LNMonitorCallback(50)


def test_logging_first_step_is_measured_too(tmp_path):
    """With ``logging_first_step`` the Trainer logs its loss at step 1 as well; the monitor measures
    the fit's first step with or without it (tests/test_baseline.py)."""
    tok = tokenizer()
    callback = LNMonitorCallback(invariance_every_n_steps=None, keep_history=True)
    trainer = transformers.Trainer(
        model=llama(), args=training_args(tmp_path, max_steps=5, logging_steps=2, logging_first_step=True,
                                          report_to=[]),
        train_dataset=records(tok, 32, 0), processing_class=tok, callbacks=[callback],
        data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=False),
    )
    trainer.train()
    loss_steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert loss_steps == [1, 2, 4]
    assert [h["step"] for h in callback.history] == [1, 2, 4, 5]


def test_a_ratio_logging_steps_is_a_share_of_max_steps():
    """The Trainer reads ``logging_steps`` below 1 as a ratio of ``max_steps`` (rounded up); the
    callback's default cadence follows it, whole-number values as they are."""
    from lnmonitor.integrations.transformers import _logging_steps

    assert [_logging_steps(v, 200) for v in (0.1, 0.001, 0.333, 1, 50.0)] == [20, 1, 67, 1, 50]
