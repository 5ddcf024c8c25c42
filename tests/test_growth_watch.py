"""The every-step growth (core/growth_watch.py) and the finding it carries through every monitor:
judged against the fit's first measured step, said at the step it crosses."""

from __future__ import annotations

import warnings

import pytest
import torch

import lnmonitor
from lnmonitor.core.meter.growth_watch import GrowthWatch, row_rms
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(width=32, depth=2, heads=2, context=16))


def _inputs(model, names):
    """The input of each named module at its last call, caught by an independent hook."""
    seen, handles = {}, []
    modules = dict(model.named_modules())
    for name in names:
        handles.append(modules[name].register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, args[0].detach().clone())))
    return seen, handles


def _rms64(x: torch.Tensor) -> float:
    ms = x.double().pow(2).mean(-1).flatten().sort().values
    return float(ms[(ms.numel() - 1) // 2].sqrt())  # the lower median, as torch.median


def test_the_watch_is_the_row_rms_of_the_last_rung_over_the_first_on_each_training_step():
    model, x = _model(), torch.randint(0, 65, (4, 16))
    seen, handles = _inputs(model, ["blocks.0.ln1", "lnf"])
    watch = GrowthWatch()
    assert watch.take(0) is None  # nothing attached
    watch.attach(model.blocks[0].ln1, model.lnf)
    model(x, x)[1].backward()
    step, value = watch.take(0)
    expected = _rms64(seen["lnf"]) / _rms64(seen["blocks.0.ln1"])
    assert step == 0 and value == pytest.approx(expected, rel=1e-6)
    assert float(row_rms(seen["lnf"])) == pytest.approx(_rms64(seen["lnf"]), rel=1e-6)
    assert watch.take(1) is None  # no forward since
    with torch.no_grad():  # validation is not a training step
        model(x, x)
    assert watch.take(2) is None
    # two micro-batches: the step's largest
    small, big = torch.randint(0, 65, (4, 16)), torch.randint(0, 65, (4, 16))
    values = []
    for batch in (small, big):
        model(batch, batch)[1].backward()
        values.append(_rms64(seen["lnf"]) / _rms64(seen["blocks.0.ln1"]))
    assert watch.take(3)[1] == pytest.approx(max(values), rel=1e-6)
    for handle in handles:
        handle.remove()
    watch.detach()
    assert not model.lnf._forward_pre_hooks and not model.blocks[0].ln1._forward_pre_hooks


def test_a_float64_forward_is_watched_in_float64_not_refused():
    """A probe's float64 reference runs the model in float64 with the watch's hooks on it: the watch
    must read it (it once raised there and turned the probe off)."""
    model, x = _model(), torch.randint(0, 65, (4, 16))
    watch = GrowthWatch()
    watch.attach(model.blocks[0].ln1, model.lnf)
    model.double()(x, x)[1].backward()
    _, value = watch.take(0)
    stream = torch.randn(3, 5, 32, dtype=torch.float64)
    assert row_rms(stream).dtype == torch.float32
    assert float(row_rms(stream)) == pytest.approx(_rms64(stream), rel=1e-7)
    assert value > 0


def test_the_meter_watches_its_ladder_once_the_roles_are_known_and_agrees_with_its_own_growth():
    model, x = _model(), torch.randint(0, 65, (8, 16))
    meter = LadderMeter(model, info=lambda _: None)
    assert meter.take_growth(0) is None  # no roles yet: nothing watched
    with meter.step():
        model(x, x)[1].backward()
    first = meter.result()
    assert meter.take_growth(0) is None  # attached after that step's forward
    with meter.step():  # both at once: the meter's histogram median against the watch's exact one
        model(x, x)[1].backward()
    measured = meter.result().figures.growth
    step, every = meter.take_growth(1)
    assert step == 1 and every == pytest.approx(measured, rel=0.03)
    assert first.figures.rungs[0] == "blocks.0.ln1" and first.figures.rungs[-1] == "lnf"
    meter.close()
    assert not model.lnf._forward_pre_hooks and meter.take_growth(2) is None


def _blow_up(model: TinyGPT) -> None:
    """What a harmful update does to the stream, at once: the last block writes 300x larger."""
    with torch.no_grad():
        model.blocks[-1].mlp.proj.weight.mul_(300.0)
        model.blocks[-1].mlp.proj.bias.mul_(300.0)


def _health(caught):
    return [w for w in caught if w.category is lnmonitor.HealthWarning]


def test_the_loop_monitor_says_the_growth_at_the_step_it_crosses_not_at_the_next_measured_one():
    from lnmonitor.integrations.loop import LoopMonitor

    model, x = _model(), torch.randint(0, 65, (4, 16))
    seen = []
    monitor = LoopMonitor(model, every_n_steps=5, images=False, summary=False, keep_history=True,
                          on_finding=seen.append, max_steps=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            if step == 7:
                _blow_up(model)
            with monitor.step(step):
                model(x, x)[1].backward()
    monitor.close()
    assert [f.kind for f in seen] == ["stream_growth"] and seen[0].step == 7  # measured: 0, 5, 10, 11
    assert seen[0].value > 20 and len(_health(caught)) == 1
    message = str(_health(caught)[0].message)
    assert "at step 7" in message and message.endswith("More: docs/findings.md#stream_growth.")
    assert _health(caught)[0].filename == __file__  # the user's line, not lnmonitor's
    assert len(message) < 300  # one sentence seen, one to try, the place in the docs
    logged = {r["step"]: r.get("lnmonitor/health/stream_growth") for r in monitor.history}
    assert logged[7] == 1.0 and logged[10] == 1.0 and logged[0] is None


def test_lightning_says_the_growth_at_the_step_it_crosses():
    import lightning as L

    from lnmonitor import LayerNormMonitor

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def training_step(self, batch, batch_idx):
            if self.global_step == 7 and batch_idx == 14:  # the first of step 7's two micro-batches
                _blow_up(self.model)
            return self.model(batch, batch)[1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights move only by _blow_up

    seen = []
    monitor = LayerNormMonitor(every_n_steps=5, images=False, summary=False, keep_history=True,
                               on_finding=seen.append)
    trainer = L.Trainer(max_steps=10, callbacks=[monitor], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    data = torch.utils.data.DataLoader(torch.randint(0, 65, (80, 16)), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), data)
    assert [(f.kind, f.step) for f in seen] == [("stream_growth", 7)] and len(_health(caught)) == 1
    assert _health(caught)[0].filename == __file__  # trainer.fit's line, not Lightning's or ours
    assert {r["step"]: r.get("lnmonitor/health/stream_growth") for r in monitor.history}[7] == 1.0
    assert not monitor.meter.model.model.lnf._forward_pre_hooks  # the watch's hooks leave with the fit


def test_the_trainer_callback_says_the_growth_at_the_step_it_crosses(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lnmonitor.integrations.transformers import LNMonitorCallback

    class BlowUp(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:  # the update that makes global_step 3, before the first log at 5
                with torch.no_grad():
                    model.transformer.h[-1].mlp.c_proj.weight.mul_(300.0)

    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    records = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (40, 16))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=9, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-9, logging_steps=5)
    seen = []
    callback = LNMonitorCallback(on_finding=seen.append, keep_history=True, invariance_every_n_steps=None)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                   train_dataset=records, callbacks=[BlowUp(), callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    # the fit's first step is measured and logged (its start and roles), the finding at step 3
    assert [(f.kind, f.step) for f in seen] == [("stream_growth", 3)] and len(_health(caught)) == 1
    tag = "lnmonitor/health/stream_growth"
    assert [e for e in trainer.state.log_history if tag in e][0] == {tag: 1.0, "step": 3}
    logged = [r["step"] for r in callback.history if "lnmonitor/ladder/growth" in r]
    assert logged == [1, 5, 9] and [r["step"] for r in callback.history][:2] == [1, 3]


def test_a_fine_tune_of_a_tall_ladder_says_its_height_once_and_raises_nothing(capsys):
    """A checkpoint whose stream is already tall (every pretrained LM's): information, not a
    finding; a healthy fine-tune that moves the ladder a little raises nothing."""
    from lnmonitor.integrations.loop import LoopMonitor

    model, x = _model(), torch.randint(0, 65, (4, 16))
    _blow_up(model)  # the checkpoint: a 300x stream from its last block
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = LoopMonitor(model, every_n_steps=5, images=False, keep_history=True, max_steps=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            with monitor.step(step):
                model(x, x)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
    start = monitor.history[0]["lnmonitor/ladder/growth"]
    assert start > 20 and not _health(caught)  # tall at its first step: no HealthWarning
    assert not any(k.startswith("lnmonitor/health/") for r in monitor.history for k in r)
    said = capsys.readouterr().err
    assert said.count("the ladder is already") == 1 and "a fact of the model this fit starts from" in said
    assert "the ladder was already" in said  # the end-of-fit summary says it too


# ---------------------------------------------------------------------------
# rows without gradient: construction (one per sequence) told apart from collapse
# ---------------------------------------------------------------------------


def _zero_grad(model, x, y, module=None, hook=None):
    """Each norm's figures and what was warned on one measured step, with ``hook`` as a forward
    pre-hook on ``module`` (None: none)."""
    warned = {}
    meter = LadderMeter(model, info=lambda _: None, warn=warned.setdefault)
    handle = module.register_forward_pre_hook(hook) if hook else None
    with meter.step():
        model(x, y)[1].backward()
    if handle:
        handle.remove()
    return meter.result().figures.by_name(), warned


def test_rows_without_a_target_are_no_fault_and_rows_whose_gradient_vanished_are():
    model, x = _model(), torch.randint(0, 65, (4, 16))
    norms, warned = _zero_grad(model, x, x)  # nanoGPT's shape: a target at every position
    assert all(f.stats.zero_grad_rows == 0 and f.stats.vanished_grad_rows == 0 for f in norms.values())
    assert not warned
    keep = torch.arange(16) < 6

    def no_target(module, args):  # the loss reads 6 of 16 positions: as labels of -100 would
        return (args[0] * keep[:, None],)

    norms, warned = _zero_grad(model, x, x, model.head, no_target)
    # causal attention: the 10 positions without a target reach none through any layer, so every
    # norm has no gradient there, the final norm too: no target, no fault
    assert all(f.stats.zero_grad_rows == 40 and f.stats.vanished_grad_rows == 0 for f in norms.values())
    assert norms["lnf"].stats.share_rows == 24 and "vanished" not in warned

    def cut(module, args):  # the second block's input passes no gradient back at 10 positions
        return (torch.where(keep[:, None], args[0], args[0].detach()),)

    norms, warned = _zero_grad(model, x, x, model.blocks[1], cut)
    # the final norm has a gradient at every position: the first block's norms lost theirs at 10
    assert norms["lnf"].stats.zero_grad_rows == 0 and norms["lnf"].stats.vanished_grad_rows == 0
    for name in ("blocks.0.ln1", "blocks.0.ln2"):
        assert norms[name].stats.vanished_grad_rows == 40 and norms[name].stats.zero_grad_rows == 0
    assert norms["blocks.1.ln1"].stats.vanished_grad_rows == 0
    said = "40 of 64 rows of blocks.0.ln1 (and rows of 1 other norms) carry no gradient where the final"
    assert said in warned["vanished"]


def test_a_causal_lms_last_token_and_its_masked_labels_have_no_target():
    transformers = pytest.importorskip("transformers")
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (3, 16))
    masked = ids.clone()
    masked[:, 8:] = -100  # no target on the second half, as a completion-only collator does to a reply

    def stats(labels):
        warned = {}
        meter = LadderMeter(model, info=lambda _: None, warn=warned.setdefault)
        with meter.step():
            model(input_ids=ids, labels=labels).loss.backward()
        return {f.name: f.stats for f in meter.result().figures.norms}, warned

    full, _ = stats(ids)
    assert all(s.zero_grad_rows == 3 and s.vanished_grad_rows == 0 for s in full.values())  # the last token
    # positions 7..15 have no target (label i + 1 is -100 from 7 on) and none after them has one
    half, warned = stats(masked)
    assert all(s.zero_grad_rows == 3 * 9 and s.vanished_grad_rows == 0 for s in half.values())
    assert "vanished" not in warned
    prompt = ids.clone()
    prompt[:, :8] = -100  # no target on the prompt, whose positions later ones read through attention
    first, warned = stats(prompt)
    assert all(s.vanished_grad_rows == 0 for s in first.values()) and "vanished" not in warned
    # after the last attention only each position's own loss reaches it: 7 prompt positions + the last
    assert first["transformer.ln_f"].zero_grad_rows == first["transformer.h.1.ln_2"].zero_grad_rows == 3 * 8
    assert first["transformer.h.0.ln_1"].zero_grad_rows == first["transformer.h.1.ln_1"].zero_grad_rows == 3


def test_a_trainer_fine_tune_of_a_tall_gpt2_at_its_defaults_raises_nothing(tmp_path):
    """Issue 34's case: a GPT-2 whose ladder is ~100x at its first step (as a pretrained one's),
    fine-tuned at lr 5e-5 through transformers.Trainer with the callback at its defaults: the
    ladder moves, the loss falls, and no finding (it was said at the first measured step before)."""
    transformers = pytest.importorskip("transformers")
    from lnmonitor.integrations.transformers import LNMonitorCallback

    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_proj.weight.mul_(150.0)
    records = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (40, 16))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=5e-5, logging_steps=10)
    callback = LNMonitorCallback(keep_history=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=records, callbacks=[callback])
    said = []
    callback.messages._info = said.append
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not _health(caught) and callback.findings.raised == {}
    assert callback.findings.start[1] > 50  # tall from its first step: a fact of the checkpoint
    assert sum("the ladder is already" in text for text in said) == 1


def test_under_torch_compile_the_growth_is_said_to_be_read_on_measured_steps_only():
    """Compiled steps run no hook added after compiling (a watch attached then takes nothing
    on them), so the meter says where the findings read the growth."""
    said = []
    LadderMeter(torch.compile(_model()), info=said.append)
    assert any("the findings read the ladder's growth on the measured steps only" in s for s in said)


def test_without_a_finding_that_reads_the_growth_nothing_is_watched():
    """findings=False, or the growth's kinds turned off: the every-step watch is not attached
    (it would cost every step for nothing)."""
    from lnmonitor.core.findings.reader import GROWTH_SIGNALS, KINDS
    from lnmonitor.integrations.loop import LoopMonitor

    growth_kinds = {name: None for name, kind in KINDS.items() if kind.signal in GROWTH_SIGNALS}
    assert growth_kinds
    for findings, watched in ((None, True), (False, False), (growth_kinds, False)):
        model, x = _model(), torch.randint(0, 65, (4, 16))
        monitor = LoopMonitor(model, every_n_steps=5, images=False, summary=False, findings=findings)
        with monitor.step(0):
            model(x, x)[1].backward()
        assert bool(model.lnf._forward_pre_hooks) is watched, findings
        monitor.close()


def test_a_hook_that_cannot_read_the_stream_stops_the_watch_not_the_training(monkeypatch):
    """An error inside the watch's hooks (here: the reduction itself fails) never reaches the
    user's forward: the step trains, the watch lets go of its hooks, the meter says why once, and
    the measured steps go on."""
    said = []
    model, x = _model(), torch.randint(0, 65, (4, 16))
    meter = LadderMeter(model, info=lambda _: None, warn=lambda key, text: said.append((key, text)))
    with meter.step():
        model(x, x)[1].backward()
    assert meter.result() is not None and model.lnf._forward_pre_hooks  # watching

    def broken(*args, **kwargs):
        raise RuntimeError("cannot reduce this stream")

    with monkeypatch.context() as patch:
        patch.setattr(torch.linalg, "vector_norm", broken)
        loss = model(x, x)[1]  # the user's forward: no exception
        loss.backward()
    assert meter.take_growth(1) is None and not model.lnf._forward_pre_hooks
    assert [key for key, _ in said].count("growth-watch") == 1 and "cannot reduce" in said[-1][1]
    with meter.step():
        model(x, x)[1].backward()
    assert meter.result() is not None and meter.take_growth(2) is None
    meter.close()
