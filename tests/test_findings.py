"""Findings (lnmonitor.core.findings.reader), the signals they read (core.findings.signals), the
tiny recipe's stability options, and no finding where nothing is wrong.  The testbed behind them,
and the records their figures are held to, are research/stability's and research/eps's tests."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import pytest
import torch

import lnmonitor
from lnmonitor.core.findings.evidence import EPS_COSTS, EPS_DELAYS, EPS_KNEE
from lnmonitor.core.findings.reader import (
    KINDS,
    Finding,
    FindingsReader,
    long_form,
    state_from_health,
)
from lnmonitor.core.findings.signals import crosses, step_signals
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.monitor.arguments import ArgumentError
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.recipe import Recipe

# ---------------------------------------------------------------------------
# signals and the reader
# ---------------------------------------------------------------------------


def _measured(model, x):
    meter = LadderMeter(model, info=lambda _: None)
    with meter.step():
        model(x, x)[1].backward()
    return meter.result()


def test_step_signals_are_the_meters_figures():
    torch.manual_seed(0)
    f = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32))).figures
    assert step_signals(f) == {"growth": f.growth, "first_eps_over_var": f.by_name()[f.rungs[0]].eps_over_var}
    assert all(math.isnan(v) for v in step_signals(None).values())
    assert crosses(-30.0, "abs>", 20.0) and not crosses(math.nan, ">", 0.0) and crosses(0.01, "<", 0.05)


def _Figures(result, **changed):
    """A real measured step with some of its ladder's figures changed (the reader reads
    ``result.figures`` only)."""
    return dataclasses.replace(result, figures=dataclasses.replace(result.figures, **changed))


def test_the_reader_raises_each_kind_once_and_logs_1_while_it_holds_0_after():
    torch.manual_seed(0)
    result = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    seen, said = [], []
    reader = FindingsReader(on_finding=seen.append, warn=said.append, name="T")
    assert reader.read(0, result).raised == []  # a healthy step says nothing
    big = _Figures(result, growth=50.0)
    first = reader.read(5, big)
    assert [f.kind for f in first.raised] == ["stream_growth"] and first.metrics == {
        "lnmonitor/health/stream_growth": 1.0}
    assert "50x" in first.raised[0].message and "step 5" in first.raised[0].message
    assert reader.read(10, big).raised == []  # once per fit
    later = reader.read(15, result)
    assert later.ended == ["stream_growth"] and later.metrics == {"lnmonitor/health/stream_growth": 0.0}
    assert reader.read(20, big).raised == [] and len(seen) == 1 and len(said) == 1
    # judged against the fit's first measured step (step 0's growth), not as an absolute height
    assert reader.start == (0, result.figures.growth)
    assert reader.raised["stream_growth"].value == 50.0 / result.figures.growth
    assert reader.raised["stream_growth"].step == 5
    again = FindingsReader(warn=said.append)
    again.load_state_dict(reader.state_dict())
    assert again.read(25, big).raised == [] and again.raised == reader.raised
    assert reader.read(30, None).metrics == {}
    reader.reset()  # a new fit, judged against its own first measured step
    assert reader.read(35, big).raised == [] and reader.start == (35, 50.0)
    assert [f.kind for f in reader.read(40, _Figures(result, growth=50.0 * 36)).raised] == ["stream_growth"]


def test_a_record_of_the_health_tags_restores_the_kinds_raised_and_whether_they_hold():
    """state_from_health: raised at a kind's first 1, holding when its last value is 1, unknown
    kinds left out; the restored reader raises nothing again."""
    torch.manual_seed(0)
    result = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    points = [(3, "stream_growth", 1.0), (4, "stream_growth", 0.0), (6, "eps_dominates", 1.0),
              (8, "stream_growth", 1.0), (9, "a_later_kind", 1.0)]
    state = state_from_health(points)
    assert {k: f["step"] for k, f in state["raised"].items()} == {"stream_growth": 3, "eps_dominates": 6}
    assert state["holding"] == ["eps_dominates", "stream_growth"]
    assert state_from_health(points[:2])["holding"] == []
    # a fresh fit (the record keeps no loss: a resumed fit's loss rule sets its minimum again)
    fresh = FindingsReader().state_dict()
    assert state_from_health([]) == {k: v for k, v in fresh.items() if k != "loss_rule"}
    said = []
    reader = FindingsReader(warn=said.append)
    reader.load_state_dict(state_from_health(points[:2]))
    reader.read(10, result)  # the resumed fit's first measured step: its growth's start
    assert reader.read(11, _Figures(result, growth=50.0 * result.figures.growth)).raised == [] and said == []
    assert reader.raised["stream_growth"].step == 3 and reader.holding == {"stream_growth"}  # again at 11


def test_on_finding_returning_true_asks_to_stop():
    torch.manual_seed(0)
    result = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    big = _Figures(result, growth=50.0 * result.figures.growth)
    for on_finding, stops in ((lambda f: True, True), (lambda f: 1, False), (None, False)):
        reader = FindingsReader(on_finding=on_finding, warn=lambda _: None)
        assert reader.read(0, result).stop is False
        assert reader.read(5, big).stop is stops


def test_findings_warn_with_health_warning_and_a_failing_on_finding_is_said_once():
    torch.manual_seed(0)
    result = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    calls = []

    def on_finding(finding: Finding):
        calls.append(finding)
        raise RuntimeError("boom")

    reader = FindingsReader(on_finding=on_finding, thresholds={"eps_dominates": 1e-9})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader.read(0, result)
        reader.read(5, _Figures(result, growth=100.0 * result.figures.growth))
    kinds = [w.category for w in caught]
    assert kinds == [lnmonitor.HealthWarning] * 3 and issubclass(lnmonitor.HealthWarning, UserWarning)
    assert len(calls) == 1 and "on_finding raised RuntimeError: boom" in str(caught[1].message)
    assert reader.on_finding is None


def test_the_eps_finding_is_short_and_its_long_form_cites_each_cost_and_delay():
    """The eps finding gives the measured costs and delays (research/eps/test_evidence.py holds
    them to their records) in its long form, and says the size is the corpus's, not a figure for
    this run."""
    torch.manual_seed(0)
    # GPT-2's init at eps 0.1: the first norm reads var ~8e-4, eps/var ~130 (docs/eps.md)
    result = _measured(TinyGPT(GPTConfig(depth=2, eps=0.1, init="gpt2")), torch.randint(0, 65, (4, 32)))
    value = step_signals(result.figures)["first_eps_over_var"]
    assert value > EPS_KNEE
    said = []
    finding = FindingsReader(warn=said.append).read(0, result).raised
    eps = [f for f in finding if f.kind == "eps_dominates"][0]
    assert eps.value == value and eps.message.endswith("More: docs/findings.md#eps_dominates.")
    assert len(eps.message) < 400 and "nats/char" not in eps.message  # short: the figures are in the docs
    meant = long_form("eps_dominates")  # ... and in the long form the summary gives
    for where, cost in EPS_COSTS.items():
        assert f"+{cost:.4f} nats/char with {where}" in meant
    for where, (budget, median, low, high) in EPS_DELAYS.items():
        assert f"{median:,} of {budget:,} steps ({low:,} to {high:,}) with {where}" in meant
    assert "the corpus's" in meant


@pytest.mark.parametrize("bad", [{"nope": 1.0}, {"stream_growth": -1.0}, {"stream_growth": math.inf},
                                 {"stream_growth": True}, [("stream_growth", 2.0)]])
def test_thresholds_are_checked(bad):
    with pytest.raises(ArgumentError):
        FindingsReader(thresholds=bad)
    with pytest.raises(ArgumentError):
        FindingsReader(on_finding=3)


def test_a_kind_set_to_none_is_off():
    reader = FindingsReader(thresholds={"stream_growth": None})
    assert reader.thresholds["stream_growth"] is None and set(reader.thresholds) == set(KINDS)


# ---------------------------------------------------------------------------
# the recipe's stability options: off by default, and then bit-identical
# ---------------------------------------------------------------------------


def test_the_stability_options_leave_the_default_recipe_as_it_was():
    recipe = Recipe()
    assert set(recipe.module_kwargs("ab")) == {
        "vocab", "width", "depth", "heads", "context", "norm", "eps", "attention", "lr", "weight_decay",
        "decay", "init", "max_steps"}
    assert "qk_norm" not in recipe.to_dict() and "schedule" not in recipe.to_dict()
    changed = Recipe(qk_norm=True, z_loss=1e-4, schedule="constant")
    assert changed.module_kwargs("ab")["qk_norm"] is True and changed.to_dict()["z_loss"] == 1e-4
    torch.manual_seed(0)
    plain = TinyGPT(GPTConfig())
    torch.manual_seed(0)
    qk = TinyGPT(GPTConfig(qk_norm=True))
    assert all(torch.equal(p, qk.state_dict()[n]) for n, p in plain.state_dict().items())
    assert set(qk.state_dict()) - set(plain.state_dict()) == {
        f"blocks.{i}.attn.{n}_norm.{p}" for i in range(4) for n in "qk" for p in ("weight", "bias")}


def test_qk_norm_normalises_each_heads_queries_and_keys_and_z_loss_adds_to_the_objective():
    from lnmonitor.tiny.module import TinyGPTModule

    torch.manual_seed(0)
    module = TinyGPTModule("abcdefgh", width=32, depth=1, heads=4, context=8, qk_norm=True, z_loss=1e-2,
                           schedule="constant")
    x = torch.randint(0, 8, (2, 8))
    logits, loss = module(x, x)
    assert module.objective(logits, loss).item() == pytest.approx(
        loss.item() + 1e-2 * logits.double().logsumexp(-1).square().mean().item(), rel=1e-6)
    assert isinstance(module.configure_optimizers(), torch.optim.AdamW)  # constant: no schedule
    attn = module.model.blocks[0].attn
    h = module.model.blocks[0].ln1(module.model.tok_emb(x) + module.model.pos_emb(torch.arange(8)))
    q, k, _ = (t.view(2, 8, 4, 8).transpose(1, 2) for t in attn.qkv(h).split(32, dim=-1))
    seen = {}
    for name in "qk":
        getattr(attn, f"{name}_norm").register_forward_hook(
            lambda module, args, out, name=name: seen.setdefault(name, args[0]))
    module(x, x)
    assert torch.allclose(seen["q"], q) and torch.allclose(seen["k"], k)  # each head's, over its 8 dims


# ---------------------------------------------------------------------------
# no finding where nothing is wrong
# ---------------------------------------------------------------------------


def _families():
    compatibility = pytest.importorskip("test_compatibility")
    return compatibility, [pytest.param(f, id=f.key) for f in compatibility.FAMILIES]


@pytest.mark.parametrize("family", _families()[1])
def test_the_compatibility_families_at_their_defaults_raise_no_finding(family):
    """One measured step of each family of tests/test_compatibility.py (random weights, its
    default initialisation), read with the default thresholds: nothing is raised."""
    compatibility = _families()[0]
    torch.manual_seed(0)
    module = compatibility.Wrapped(family.build(), family.hf)
    batch = next(iter(compatibility.data(0, None, family.decoder)))
    meter = LadderMeter(module, info=lambda _: None, warn=lambda *_: None)
    with meter.step():
        module.training_step(batch, 0).backward()
    said = []
    reading = FindingsReader(warn=said.append).read(0, meter.result())
    assert reading.raised == [] and said == []


# ---------------------------------------------------------------------------
# the three integrations: one shared call each
# ---------------------------------------------------------------------------

EVERY_STEP = {"stream_growth": 0.5}  # a growth every model has: the finding at the first measured step


def _stopper(calls):
    def on_finding(finding):
        calls.append(finding)
        return True
    return on_finding


def test_lightning_logs_the_finding_warns_once_and_stops_when_on_finding_says_so():
    import lightning as L

    from lnmonitor import LayerNormMonitor

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyGPT(GPTConfig(width=32, depth=2, heads=2, context=16))

        def training_step(self, batch, batch_idx):
            return self.model(batch, batch)[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    calls = []
    monitor = LayerNormMonitor(every_n_steps=1, images=False, summary=False, keep_history=True,
                               findings=EVERY_STEP, on_finding=_stopper(calls))
    trainer = L.Trainer(max_steps=5, callbacks=[monitor], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), torch.utils.data.DataLoader(torch.randint(0, 65, (40, 16)), batch_size=4))
    health = [w for w in caught if w.category is lnmonitor.HealthWarning]
    assert len(health) == 1 and "LayerNormMonitor: the residual stream grew" in str(health[0].message)
    assert len(calls) == 1 and calls[0].step == 0 and trainer.global_step == 1  # stopped after step 0
    assert monitor.history[0]["lnmonitor/health/stream_growth"] == 1.0
    quiet = LayerNormMonitor(findings=False)
    assert quiet.findings is None
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"findings\['stream_growth'\] must be"):
        LayerNormMonitor(findings={"stream_growth": 0})


def _gpt2_trainer(out, **args):
    """A real transformers.Trainer on a tiny random GPT-2 (40 fixed sequences, batches of 4)."""
    transformers = pytest.importorskip("transformers")
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (40, 16))
    settings = dict(output_dir=str(out), max_steps=5, per_device_train_batch_size=4, save_strategy="no",
                    report_to=[], use_cpu=True, disable_tqdm=True)
    args = transformers.TrainingArguments(**{**settings, **args})
    records = [{"input_ids": x, "labels": x} for x in ids]
    return transformers.Trainer(model=model, args=args, train_dataset=records)


def test_the_trainer_callback_stops_through_control_when_on_finding_says_so(tmp_path):
    from lnmonitor.integrations.transformers import LNMonitorCallback

    hf = _gpt2_trainer(tmp_path)
    calls = []
    callback = LNMonitorCallback(hf, every_n_steps=1, invariance_every_n_steps=None, keep_history=True,
                                 findings=EVERY_STEP, on_finding=_stopper(calls))
    hf.add_callback(callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hf.train().global_step == 1
    assert sum(w.category is lnmonitor.HealthWarning for w in caught) == 1 and len(calls) == 1
    assert callback.history[0]["lnmonitor/health/stream_growth"] == 1.0


def test_a_trainer_resumed_from_a_checkpoint_does_not_raise_a_finding_again(tmp_path):
    """A ``train(resume_from_checkpoint=...)`` is the same fit: the kinds raised before the
    checkpoint come back from its trainer_state.json, where the monitor keeps each change of a health
    tag (1 raised at step 1; 0 at step 2, as ``on_finding`` lifts the threshold), so the finding is
    said once over both runs; the resumed run, whose threshold holds again, logs the tag 1 and keeps
    that change (so it restored "not holding").  The Trainer's own entries are untouched.  A
    checkpoint without those entries (an older lnmonitor's) resumes and raises it anew, once."""
    import json
    import shutil

    from lnmonitor.integrations.transformers import LNMonitorCallback

    tag, calls = "lnmonitor/health/stream_growth", []

    def run(resume=None):
        def lift(finding):  # the finding no longer holds from the next measured step on
            calls.append(finding)
            callback.findings.thresholds["stream_growth"] = 1e6

        callback = LNMonitorCallback(every_n_steps=1, invariance_every_n_steps=None, keep_history=True,
                                     findings=EVERY_STEP, on_finding=lift)
        hf = _gpt2_trainer(tmp_path / "out", max_steps=4, logging_steps=1, save_strategy="steps",
                           save_steps=2)
        hf.add_callback(callback)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf.train(resume_from_checkpoint=resume)
        return hf, callback, [w for w in caught if w.category is lnmonitor.HealthWarning]

    first, first_cb, raised = run()
    assert len(raised) == 1 and [(h["step"], h[tag]) for h in first_cb.history] == [(1, 1.0), (2, 0.0),
                                                                                       (3, 0.0), (4, 0.0)]
    checkpoint = tmp_path / "out" / "checkpoint-2"
    resumed, resumed_cb, again = run(str(checkpoint))
    assert again == [] and len(calls) == 1
    assert [(h["step"], h[tag]) for h in resumed_cb.history] == [(3, 1.0), (4, 1.0)]  # it holds again
    assert resumed_cb.findings.raised["stream_growth"].step == 1  # raised at step 1, before the checkpoint

    saved = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    # the fit's start goes with the first change: a resumed fit judges from it
    start = {"lnmonitor/ladder/growth": first_cb.findings.start[1]}
    changes = [{tag: 1.0, **start, "step": 1}, {tag: 0.0, "step": 2}]
    assert resumed_cb.findings.start == first_cb.findings.start
    assert [e for e in saved if tag in e] == changes
    assert [e for e in resumed.state.log_history if tag in e] == [*changes, {tag: 1.0, "step": 3}]
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4]
    assert "train_runtime" in first.state.log_history[-1]  # the Trainer's summary is still the last

    old = tmp_path / "old"
    shutil.copytree(checkpoint, old)
    state = json.loads((old / "trainer_state.json").read_text())
    state["log_history"] = [e for e in state["log_history"] if "loss" in e]
    (old / "trainer_state.json").write_text(json.dumps(state))
    _, _, anew = run(str(old))
    assert len(anew) == 1 and len(calls) == 2  # nothing said it was raised: it is raised, once


def test_the_loop_monitor_sets_should_stop_and_logs_1_while_it_holds_0_after():
    from lnmonitor.integrations.loop import LoopMonitor

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(width=32, depth=2, heads=2, context=16))
    calls = []
    monitor = LoopMonitor(model, every_n_steps=1, findings=EVERY_STEP, on_finding=_stopper(calls),
                          keep_history=True)
    x = torch.randint(0, 65, (4, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with monitor.step(0):
            model(x, x)[1].backward()
        monitor.findings.thresholds["stream_growth"] = 1e6  # no longer holds at the next step
        with monitor.step(1):
            model(x, x)[1].backward()
    assert monitor.should_stop and len(calls) == 1
    assert [r["lnmonitor/health/stream_growth"] for r in monitor.history] == [1.0, 0.0]
    assert sum(w.category is lnmonitor.HealthWarning for w in caught) == 1
    with pytest.raises(ArgumentError):
        LoopMonitor(model, on_finding="stop")


def test_the_summary_lists_the_findings_with_when_they_were_raised_and_whether_they_held():
    from lnmonitor.views.summary import health_lines, summary_text

    curves = {"lnmonitor/health/stream_growth": [(5, 1.0), (10, 1.0), (15, 0.0)],
              "lnmonitor/health/eps_dominates": [(0, 1.0), (15, 1.0)],
              "lnmonitor/ladder/growth": [(0, 2.0), (15, 30.0)]}
    assert health_lines(curves) == [
        "findings (docs/findings.md):",
        "  eps_dominates: raised at step 0; still held at step 15",
        f"    what it meant in the testbed: {long_form('eps_dominates')}",
        "  stream_growth: raised at step 5; had ended at step 15",
        f"    what it meant in the testbed: {long_form('stream_growth')}",
    ]
    assert summary_text(curves).endswith(long_form("stream_growth"))
    assert health_lines({"lnmonitor/ladder/growth": [(0, 2.0)]}) == []


@pytest.mark.slow
@pytest.mark.parametrize("script, folder", [
    (["plain_loop.py"], "plain_loop"),
    (["own_module.py"], "own_module/version_0"),
    (["transformers_causal_lm.py", "--family", "gpt2"], "transformers-gpt2/version_0"),
])
def test_the_examples_raise_no_finding(tmp_path, script, folder):
    """The examples as written (their few test steps): no HealthWarning, no health metric."""
    import subprocess
    import sys

    from conftest import events

    examples = Path(__file__).resolve().parent.parent / "examples"
    proc = subprocess.run([sys.executable, str(examples / script[0]), *script[1:], "--steps", "3", "--out",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HealthWarning" not in proc.stderr
    tags = set(events(tmp_path / folder).Tags()["scalars"])
    assert any(t.startswith("lnmonitor/ladder/") for t in tags)
    assert not any(t.startswith("lnmonitor/health/") for t in tags)


@pytest.mark.slow
@pytest.mark.parametrize("integration", ["lightning", "trainer", "loop"])
def test_the_stop_on_finding_example_stops_each_integration_at_its_first_finding(tmp_path, integration):
    import re
    import subprocess
    import sys

    examples = Path(__file__).resolve().parent.parent / "examples"
    proc = subprocess.run([sys.executable, str(examples / "stop_on_finding.py"), "--integration", integration,
                           "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HealthWarning" in proc.stderr and "stream_growth" in proc.stdout
    trained = int(re.search(rf"{integration}: trained (\d+) of 250 steps", proc.stdout).group(1))
    assert trained <= 10  # the lr-0.1 run stops at its first measured finding, not at step 250
