"""The plain loss rule and what the norms did when it fired (issue 44): ``loss_blowup``.

No norm signal led a plain loss rule on the held-out mid-run testbed (research/midrun), so the
finding for a mid-run blow-up is said when the loss rule fires -- with what a loss curve cannot
give: what the stream and the final norm did between the measured step before and the one the
monitor measures right after."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lnmonitor.core.findings.loss_rule import LOSS_RULE_AFTER, LadderSnapshot, LossRule, what_the_norms_did
from lnmonitor.core.findings.reader import FindingsReader
from lnmonitor.errors import HealthWarning
from lnmonitor.integrations.loop import LoopMonitor
from lnmonitor.tiny.model import GPTConfig, TinyGPT


def test_the_rule_is_the_loss_over_its_running_minimum_after_its_first_losses():
    rule = LossRule()
    early = [rule.ratio(v) for v in [4.0, 3.0, 5.0] + [2.0] * (LOSS_RULE_AFTER - 3)]
    assert all(math.isnan(r) for r in early)  # a fit's first losses set the minimum
    assert rule.ratio(3.0) == 1.5 and rule.ratio(1.0) == 0.5 and rule.ratio(1.6) == 1.6
    assert rule.ratio(math.nan) == math.inf and rule.minimum == 1.0
    again = LossRule()
    again.load_state_dict(rule.state_dict())
    assert again.ratio(2.0) == 2.0


def _snapshot(step, rms, growth, inv_sigma):
    return LadderSnapshot(step, dict(zip(("b0", "b1", "lnf"), rms, strict=True)), growth, inv_sigma)


def test_what_the_norms_did_compares_the_measured_steps_around_the_loss():
    start, before = _snapshot(0, (1.0, 1.0, 1.0), 1.0, 1.0), _snapshot(50, (1.0, 2.0, 4.0), 4.0, 0.25)
    after = _snapshot(52, (1.1, 20.0, 48.0), 43.6, 0.02)
    said = what_the_norms_did(start, before, after)
    assert said == ("between step 50 and step 52 the ladder's growth went from 4x to 43.6x (43.6x its "
                    "value at the fit's start); the stream's rms grew most at lnf's input (12x; at b0's "
                    "1.1x); the final norm's 1/sigma went 0.08x (it divides the gradient of every layer "
                    "before it by the stream's scale): as in every learning-rate and optimizer-state "
                    "blow-up of the testbed (0.02-0.84x there; 1-1.64x in its bursts of bad data): check the "
                    "learning rate and the optimizer's state")
    burst = _snapshot(52, (1.0, 2.0, 4.0), 4.0, 0.3)  # nothing grew, 1/sigma rose 1.2x: a burst's
    assert what_the_norms_did(start, before, burst).endswith("look at the step's data")
    between = _snapshot(52, (1.0, 2.0, 4.0), 4.0, 0.23)
    assert what_the_norms_did(start, before, between).endswith("its data bursts: 1-1.64x)")
    assert what_the_norms_did(start, before, None).startswith("no step was measured around it")


class _Result:
    def __init__(self, figures):
        self.figures = figures


def _figures(rms, growth):
    from types import SimpleNamespace

    norms = [SimpleNamespace(name=n, rms=r, inv_sigma=1 / r, stats=SimpleNamespace(
        vanished_grad_rows=0, share_rows=1, share_p90=0.5, share_max=0.5), eps_over_var=1e-5,
        transmission=1e-5) for n, r in zip(("b0", "b1", "lnf"), rms, strict=True)]
    return SimpleNamespace(norms=norms, rungs=["b0", "b1", "lnf"], final="lnf", growth=growth,
                           attenuation=growth, by_name=lambda: {f.name: f for f in norms})


def test_the_reader_says_it_with_the_next_measured_step_once_and_holds_it_while_the_loss_is_high():
    said, stops = [], []
    reader = FindingsReader(warn=said.append, on_finding=lambda f: stops.append(f) or True)
    reader.read(0, _Result(_figures((1.0, 1.0, 1.0), 1.0)))
    for step in range(1, 30):
        assert reader.read_loss(step, 2.0).raised == []
    reader.read(30, _Result(_figures((1.0, 1.2, 1.5), 1.5)))
    assert reader.read_loss(31, 3.5).raised == [] and reader.pending_loss is not None  # 1.75x: pending
    assert reader.read_loss(32, 9.0).raised == [] and not said  # said with the measured step, once
    reading = reader.read(33, _Result(_figures((1.0, 6.0, 30.0), 30.0)))
    [finding] = reading.raised
    assert finding.kind == "loss_blowup" and finding.step == 31 and finding.value == 1.75 and reading.stop
    assert said == [finding.message] and stops == [finding]
    assert "the loss rose to 3.5 at step 31, 1.75x its lowest so far (2; the plain loss rule: above 1.5x)" \
        in finding.message
    assert "between step 30 and step 33 the ladder's growth went from 1.5x to 30x (30x its value at the " \
           "fit's start); the stream's rms grew most at lnf's input (20x; at b0's 1x)" in finding.message
    assert reading.metrics["lnmonitor/health/loss_blowup"] == 1.0
    assert reader.read_loss(34, 2.1).ended == ["loss_blowup"]  # the loss came back
    assert reader.read_loss(35, 5.0).raised == [] and reader.pending_loss is None  # raised once a fit
    state = reader.state_dict()
    resumed = FindingsReader()
    resumed.load_state_dict(state)
    assert resumed.loss_rule.minimum == 2.0 and resumed.first == reader.first
    assert "loss_blowup" in resumed.raised


def test_a_loss_rule_set_or_off_by_the_findings_argument():
    assert FindingsReader(thresholds={"loss_blowup": 2.0}).thresholds["loss_blowup"] == 2.0
    reader = FindingsReader(thresholds={"loss_blowup": None}, warn=pytest.fail)
    for step in range(40):
        reader.read_loss(step, 1.0 if step < 20 else 100.0)
    assert reader.pending_loss is None and reader.raised == {}


def _char_loop(lr_bug_at: int | None, steps: int = 110, **kw):
    """A TinyGPT trained on a low-entropy stream of tokens, the learning rate x100 from
    ``lr_bug_at`` (a schedule bug); the loop monitor measuring every 10th step."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(width=32, depth=4, heads=2, context=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = LoopMonitor(model, every_n_steps=10, invariance_every_n_steps=None, images=False,
                          summary=False, keep_history=True, **kw)
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 16, (5000,), generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if step == lr_bug_at:
                for group in optimizer.param_groups:
                    group["lr"] = 0.3
            starts = torch.randint(0, 4900, (8,), generator=g)
            x = torch.stack([text[i: i + 16] for i in starts])
            y = torch.stack([text[i + 1: i + 17] for i in starts])
            with monitor.step(step):
                loss = model(x, y)[1]
                loss.backward()
                monitor.add_loss(loss)
            optimizer.step()
            optimizer.zero_grad()
    return monitor, [str(w.message) for w in caught if issubclass(w.category, HealthWarning)]


def test_the_loop_monitor_says_a_mid_run_blow_up_with_the_step_after_it_measured():
    monitor, health = _char_loop(lr_bug_at=80)
    [said] = [h for h in health if "loss_blowup" in h]
    finding = monitor.findings.raised["loss_blowup"]
    assert 80 < finding.step <= 83 and "the plain loss rule" in said
    measured = [h["step"] for h in monitor.history if "lnmonitor/ladder/growth" in h]
    assert finding.step + 1 in measured and finding.step + 1 not in range(0, 110, 10)  # measured for it
    assert f"between step 80 and step {finding.step + 1} the ladder's growth went from" in said
    health_points = {h["step"]: h["lnmonitor/health/loss_blowup"] for h in monitor.history
                     if "lnmonitor/health/loss_blowup" in h}
    assert health_points[finding.step + 1] == 1.0


def test_a_healthy_loop_says_nothing_and_a_loop_without_losses_pays_nothing():
    monitor, health = _char_loop(lr_bug_at=None, steps=60)
    assert health == [] and monitor.findings.loss_rule.seen == 60
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(width=32, depth=2, heads=2, context=16))
    quiet = LoopMonitor(model, every_n_steps=10, invariance_every_n_steps=None, images=False, summary=False)
    x = torch.randint(0, 65, (4, 16))
    for step in range(3):
        with quiet.step(step):
            model(x, x)[1].backward()
    assert quiet.findings.loss_rule.seen == 0 and quiet.monitor._losses is None


def test_the_lightning_callback_reads_the_training_steps_loss():
    """The loss of ``training_step`` (``outputs``, each micro-batch's: their mean a step) goes to
    the rule; the blow-up is said at the step measured right after it."""
    import lightning as L

    from lnmonitor import LayerNormMonitor

    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 16, (5000,), generator=g)
    starts = torch.randint(0, 4900, (8 * 110,), generator=g)
    data = [(text[i: i + 16], text[i + 1: i + 17]) for i in starts]

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(GPTConfig(width=32, depth=4, heads=2, context=16))

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 80:  # a schedule bug
                for group in self.optimizers().optimizer.param_groups:
                    group["lr"] = 0.3
            return self.model(*batch)[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    monitor = LayerNormMonitor(every_n_steps=10, images=False, summary=False, keep_history=True)
    trainer = L.Trainer(max_steps=100, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[monitor], accelerator="cpu",
                        accumulate_grad_batches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    health = [str(w.message) for w in caught if issubclass(w.category, HealthWarning)]
    finding = monitor.findings.raised["loss_blowup"]
    assert 80 <= finding.step <= 83 and sum("loss_blowup" in h for h in health) == 1
    assert monitor.findings.loss_rule.seen == 100  # one loss a step, of its two micro-batches
    measured = [h["step"] for h in monitor.history if "lnmonitor/ladder/growth" in h]
    assert finding.step + 1 in measured and "between step 80 and step" in finding.message


def test_the_trainer_callback_reads_the_loss_the_trainer_logs(tmp_path):
    """The Trainer hands its callbacks no step's loss but the one it logs (the mean since its last
    log, the same on every process): the rule reads that, at its logging steps."""
    transformers = pytest.importorskip("transformers")
    from lnmonitor.integrations.transformers import LNMonitorCallback

    class ScheduleBug(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            if state.global_step == 40:  # the schedule's base, as a bug in it would
                lr_scheduler.base_lrs = [0.5 for _ in lr_scheduler.base_lrs]
                for group in optimizer.param_groups:
                    group["lr"] = 0.5

    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=16, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 16, (5000,), generator=g)
    records = [{"input_ids": text[i: i + 16], "labels": text[i: i + 16]}
               for i in torch.randint(0, 4900, (240,), generator=g).tolist()]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=60, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=3e-3, logging_steps=2,
        lr_scheduler_type="constant", dataloader_num_workers=0)
    callback = LNMonitorCallback(keep_history=True, invariance_every_n_steps=None, summary=False)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                   train_dataset=records, callbacks=[ScheduleBug(), callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    health = [str(w.message) for w in caught if issubclass(w.category, HealthWarning)]
    finding = callback.findings.raised["loss_blowup"]
    assert finding.step in range(42, 50, 2) and sum("loss_blowup" in h for h in health) == 1
    assert callback.findings.loss_rule.seen == 30  # one logged loss every 2 steps
    tag = "lnmonitor/health/loss_blowup"
    assert [e[tag] for e in trainer.state.log_history if tag in e][0] == 1.0  # for a resumed fit


def test_a_loss_that_is_no_number_is_left_out_said_once():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(width=32, depth=2, heads=2, context=16))
    monitor = LoopMonitor(model, every_n_steps=10, invariance_every_n_steps=None, images=False,
                          summary=False)
    x = torch.randint(0, 65, (4, 16))
    said = r"the loss handed over is a Tensor of shape \(4, 16\), not a number"
    with pytest.warns(UserWarning, match=said):
        for step in range(3):
            with monitor.step(step):
                logits, loss = model(x, x)
                loss.backward()
                monitor.add_loss(logits[..., 0])  # a mistake: per-position values
                monitor.add_loss("2.0")
    assert monitor.findings.loss_rule.seen == 0 and monitor.off_reason is None
