"""One baseline per run (issue 44): every monitor measures and logs the fit's first step, the model
before any update, whatever its cadence; the warning and the summary quote that one start; a
resumed Trainer fit judges from it again; the summary says "findings: none" when none was raised
(and that findings were off when they were), and labels the invariance control as one."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lnmonitor.errors import HealthWarning  # noqa: E402
from lnmonitor.integrations.transformers import LNMonitorCallback  # noqa: E402
from lnmonitor.views.summary import summary_text  # noqa: E402


def gpt2(tall: bool = False) -> torch.nn.Module:
    """A small GPT-2 (ladder ~1.2x before any update); ``tall``: ~100x, as a pretrained checkpoint's."""
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    if tall:
        with torch.no_grad():
            for block in model.transformer.h:
                block.mlp.c_proj.weight.mul_(150.0)
    return model


def fine_tune(tmp_path, model, lr: float, steps: int = 20, **kw):
    """``model`` fine-tuned through the Trainer, logging every 10 steps (not the first); the
    callback, what it said, its HealthWarnings and the summary."""
    records = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (80, 16),
                                                                     generator=torch.Generator().manual_seed(0))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=lr, logging_steps=10,
        lr_scheduler_type="constant", dataloader_num_workers=0)
    callback = LNMonitorCallback(keep_history=True, invariance_every_n_steps=None, **kw)
    said = []
    callback.messages._info = said.append
    trainer = transformers.Trainer(model=model, args=args, train_dataset=records, callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    health = [str(w.message) for w in caught if issubclass(w.category, HealthWarning)]
    return callback, said, health, next(s for s in said if "lnmonitor summary" in s)


def test_the_trainer_callback_judges_and_summarises_from_the_fit_s_first_step(tmp_path):
    """The issue's case: a GPT-2 fine-tuned at lr 0.1, the Trainer logging every 10 steps.  The
    first step is logged (step 1: the update that ends there is measured on the model before it),
    and the warning and the summary quote its growth; nothing calls the growth this fit caused a
    fact of the checkpoint."""
    callback, said, health, summary = fine_tune(tmp_path, gpt2(), lr=0.1)
    steps = [h["step"] for h in callback.history if "lnmonitor/ladder/growth" in h]
    assert steps[0] == 1 and 10 in steps and 20 in steps
    start = callback.findings.start
    assert start == (1, callback.history[0]["lnmonitor/ladder/growth"]) and start[1] < 2
    assert len(health) == 1 and f"went from {start[1]:,.1f}x at the fit's first step" in health[0]
    assert f"x, {start[1]:.3g}x at step 1\n" in summary and "already" not in summary
    assert "stream_growth: raised at step" in summary and "findings: none" not in summary


def test_a_healthy_run_says_findings_none_and_findings_off_says_so(tmp_path):
    """A tall checkpoint fine-tuned gently: its height is said from the same start, and nothing
    was found; with findings off, the summary says that instead."""
    model = gpt2(tall=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    callback, said, health, summary = fine_tune(tmp_path / "on", model, lr=1e-4, steps=10)
    assert not health and callback.findings.raised == {}
    start = callback.findings.start
    assert start[0] == 1 and start[1] > 50
    assert f"the ladder was already {start[1]:.3g}x at the fit's first step (1, before any update)" in summary
    assert sum(f"the ladder is already {start[1]:,.0f}x at the fit's first step (1," in s for s in said) == 1
    watched = "stream_growth above 35, loss_blowup above 1.5, eps_dominates above 27.2"
    assert f"findings: none (watched: {watched})" in summary
    model.load_state_dict(state)
    _, _, _, summary = fine_tune(tmp_path / "off", model, lr=1e-4, steps=10, findings=False)
    assert "findings: none (findings were off)" in summary


def test_a_resumed_trainer_fit_judges_from_the_start_it_kept(tmp_path):
    """The start goes to ``state.log_history`` (which a checkpoint saves) with the first step's
    growth; a fit resumed from the checkpoint judges from it, not from its own first step."""
    records = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (40, 16))]

    def trainer(steps, callback):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, save_strategy="steps",
            save_steps=4, report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-4, logging_steps=4,
            dataloader_num_workers=0)
        return transformers.Trainer(model=gpt2(tall=True), args=args, train_dataset=records,
                                    callbacks=[callback])

    first = LNMonitorCallback(keep_history=True, invariance_every_n_steps=None, summary=False)
    trainer(4, first).train()
    start = first.findings.start
    assert start[0] == 1 and math.isfinite(start[1])
    resumed = LNMonitorCallback(keep_history=True, invariance_every_n_steps=None, summary=False)
    trainer(8, resumed).train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert resumed.findings.start == start
    assert [h["step"] for h in resumed.history if "lnmonitor/ladder/growth" in h] == [8]  # not step 5


def test_the_summary_labels_the_invariance_control_as_one():
    curves = {f"lnmonitor/invariance/{case}/dloss": [(4, value)]
              for case, value in (("shift_5", 1e-7), ("scale_3", 2e-7), ("axis_5", 0.3))}
    text = summary_text(curves)
    header = next(line for line in text.splitlines() if "final-norm invariance" in line)
    assert "axis_5 (control)" in header and "shift_5 (control)" not in header
