"""Findings (lnmonitor.core.findings.reader), the signals they read (core.findings.signals), the
scales no norm governs (experiments.stability.scales), the testbed's events and the peers' rules
(experiments.stability.events), the tiny recipe's stability options, and no finding where nothing is wrong."""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from pathlib import Path

import pytest
import torch

import lnmonitor
from lnmonitor.core.findings.reader import (
    EPS_COSTS,
    EPS_KNEE,
    KINDS,
    Finding,
    FindingsReader,
    long_form,
    state_from_health,
)
from lnmonitor.core.findings.signals import crosses, step_signals
from lnmonitor.core.hooks import unmeasured
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.monitor.arguments import ArgumentError
from lnmonitor.experiments.stability import events as ev
from lnmonitor.experiments.stability.candidate_signals import candidate_signals, growth_jump, growth_rate
from lnmonitor.experiments.stability.scales import ScaleTap, attention_logit_max, output_logit_scales
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.recipe import Recipe

# ---------------------------------------------------------------------------
# events, exactly as docs/findings.md defines them
# ---------------------------------------------------------------------------


def test_divergence_is_20_steps_above_twice_the_running_minimum_or_a_non_finite_loss():
    loss = [4.0, 3.0, 2.0] + [4.1] * 19 + [1.0]
    assert ev.divergence(loss) is None  # 19 steps above 2x the minimum: not yet
    assert ev.divergence([4.0, 3.0, 2.0] + [4.1] * 20) == 3
    assert ev.divergence([4.0, 3.0, 2.0] + [4.0] * 30) is None  # 2x exactly is not above
    assert ev.divergence([4.0, 3.0, math.nan]) == 2
    assert ev.divergence([4.0, math.inf]) == 1


def test_a_spike_is_a_loss_above_1_25x_the_median_of_the_20_before():
    flat = [2.0] * 30
    assert ev.spike(flat) is None
    assert ev.spike(flat[:25] + [2.51] + flat[:4]) == 25
    assert ev.spike(flat[:25] + [2.5] + flat[:4]) is None
    assert ev.spike([2.0] * 10 + [9.0]) is None  # fewer than 20 steps before it


def test_damage_is_a_final_loss_beyond_the_margin_with_its_onset_on_the_smoothed_training_loss():
    best = [3.0] * 100 + [1.9] * 200
    mine = [3.0] * 150 + [2.5] * 150
    onset = ev.damage_onset(mine, best, final=2.5, best_final=1.9)
    assert onset == 104
    # the onset: the first step from which the 50-step means stay more than 0.10 apart
    gap = [sum(mine[max(0, i - 49):i + 1]) / min(i + 1, 50) - sum(best[max(0, i - 49):i + 1]) / min(i + 1, 50)
           for i in range(300)]
    assert onset == next(i for i in range(300) if all(g > 0.10 for g in gap[i:]))
    assert ev.damage_onset(mine, best, final=2.0, best_final=1.9) is None  # within the margin


# ---------------------------------------------------------------------------
# the peers' rules (llm-foundry KillLossSpike, OLMo-core StabilityMonitorCallback)
# ---------------------------------------------------------------------------


def test_kill_loss_spike_fires_on_the_fifth_outlier_after_a_full_window():
    loss = [1.0] * 100 + [3.0] * 10
    assert ev.kill_loss_spike(loss) == 104  # outliers at 100..104: the counter passes patience 4
    assert ev.kill_loss_spike([1.0] * 100 + [3.0] * 4 + [1.0] + [3.0] * 4) is None  # reset between
    # step 99 is not checked (the window holds 99 losses): the fifth checked outlier is step 104
    assert ev.kill_loss_spike([1.0] * 99 + [3.0] * 10) == 104
    assert ev.kill_loss_spike([1.0] * 50 + [math.nan] * 60) is None  # a nan is no outlier to it
    assert ev.kill_loss_spike([11.0] * 250) == 200  # persistently above loss_cap 10 after 2 windows


def test_olmo_stability_monitor_fires_above_mean_plus_6_population_sd_of_the_last_128():
    base = [1.0 + 0.1 * (i % 2) for i in range(128)]  # mean 1.05, population sd 0.05
    assert ev.olmo_stability_monitor(base + [1.05 + 6 * 0.05 + 1e-9]) == 128
    assert ev.olmo_stability_monitor(base + [1.05 + 6 * 0.05 - 1e-9]) is None
    assert ev.olmo_stability_monitor([1.0] * 200 + [100.0]) is None  # sd 0: never
    assert ev.olmo_stability_monitor(base[:127] + [9.0]) is None  # a window of 127 is not full
    grad = base + [9.0]
    assert ev.olmo_stability_monitor(base + [1.0], grad) == 128  # the gradient norm counts too


# ---------------------------------------------------------------------------
# scales: attention logits and output logits, against float64
# ---------------------------------------------------------------------------


def _scores64(q, k, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (q.double() @ k.double().transpose(-2, -1)) * scale


def test_attention_logit_max_leaves_masked_entries_out():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 6, 8, generator=g), torch.randn(2, 3, 6, 8, generator=g)
    s = _scores64(q, k)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert attention_logit_max(q, k).item() == pytest.approx(s.max().item(), rel=1e-6)
    assert attention_logit_max(q, k, is_causal=True).item() == pytest.approx(
        s.masked_fill(~causal, -math.inf).max().item(), rel=1e-6)
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.5
    mask[..., 0] = True
    assert attention_logit_max(q, k, attn_mask=mask, scale=0.3).item() == pytest.approx(
        _scores64(q, k, 0.3).masked_fill(~mask, -math.inf).max().item(), rel=1e-6)
    additive = torch.zeros(6, 6).masked_fill(~causal, -math.inf)
    assert attention_logit_max(q, k, attn_mask=additive).item() == pytest.approx(
        s.masked_fill(~causal, -math.inf).max().item(), rel=1e-6)
    kv = torch.randn(2, 1, 6, 8, generator=g)  # grouped-query: one key head for three query heads
    assert attention_logit_max(q, kv, enable_gqa=True).item() == pytest.approx(
        _scores64(q, kv.expand(2, 3, 6, 8)).max().item(), rel=1e-6)


def test_output_logit_scales_skip_ignored_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=g) * 3
    target = torch.tensor([1, -100, 2, 3, -100])
    kept = logits.double()[target != -100]
    got = output_logit_scales(logits, target)
    assert got[0].item() == pytest.approx(kept.max().item(), rel=1e-6)
    assert got[1].item() == pytest.approx(kept.logsumexp(-1).mean().item(), rel=1e-6)
    batched = logits.reshape(1, 5, 7).transpose(1, 2)  # (N, C, d): classes on dim 1
    assert output_logit_scales(batched, target.reshape(1, 5)).tolist() == pytest.approx(got.tolist())


def test_scale_tap_sees_each_layer_on_the_step_only():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(depth=2))
    x = torch.randint(0, 65, (3, 16))
    tap = ScaleTap()
    tap.start()
    logits, loss = model(x, x)
    with unmeasured():
        model(x, x)  # a probe's pass: not the step's
    with torch.no_grad():
        model(x, x)
    tap.stop()
    model(x, x)  # after the step: not seen
    scales = tap.result()
    assert len(scales.attention) == 2
    assert scales.logit_max == pytest.approx(logits.max().item(), rel=1e-6)
    assert scales.z_mean == pytest.approx(logits.double().logsumexp(-1).mean().item(), rel=1e-6)
    # the first layer's largest logit from its own q and k
    h = model.tok_emb(x) + model.pos_emb(torch.arange(16))
    q, k, _ = model.blocks[0].attn.qkv(model.blocks[0].ln1(h)).split(128, dim=-1)
    q, k = (t.view(3, 16, 4, 32).transpose(1, 2) for t in (q, k))
    s = _scores64(q, k).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), -math.inf)
    assert scales.attention[0] == pytest.approx(s.max().item(), rel=1e-5)
    assert tap.result() is None  # forgotten once read


# ---------------------------------------------------------------------------
# signals and the reader
# ---------------------------------------------------------------------------


def _measured(model, x):
    meter, tap = LadderMeter(model, say=lambda _: None), ScaleTap()
    meter.start()
    tap.start()
    model(x, x)[1].backward()
    tap.stop()
    meter.stop()
    return meter.result(), tap.result()


def test_step_signals_are_the_meters_figures():
    torch.manual_seed(0)
    result, scales = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    s = candidate_signals(result.figures, scales)
    f = result.figures
    by = f.by_name()
    assert s["growth"] == f.growth and s["attenuation"] == f.attenuation
    assert s["inv_sigma_first"] == by[f.rungs[0]].inv_sigma and s["inv_sigma_last"] == by["lnf"].inv_sigma
    assert s["first_eps_over_var"] == by[f.rungs[0]].eps_over_var
    assert s["final_share_max"] == by["lnf"].stats.share_max
    assert s["attention_max"] == max(scales.attention) and s["z_mean"] == scales.z_mean
    assert math.isnan(candidate_signals(f)["attention_max"]) and "attention_max" not in step_signals(f)
    assert growth_rate((10, 2.0), 20, 20.0) == pytest.approx(0.1)
    assert math.isnan(growth_rate(None, 20, 20.0)) and math.isnan(growth_rate((20, 2.0), 20, 3.0))
    assert crosses(-30.0, "abs>", 20.0) and not crosses(math.nan, ">", 0.0) and crosses(0.01, "<", 0.05)


def test_growth_jump_is_the_growth_over_its_least_value_in_the_ten_steps_before():
    read = [(0, 2.0), (5, 1.5), (9, 4.0), (12, math.nan), (13, 3.0)]
    assert growth_jump(read, 14, 60.0) == 60.0 / 1.5  # steps 4..13: 5, 9, 13 (nan is no value)
    assert growth_jump(read, 16, 60.0) == 60.0 / 3.0  # steps 6..15: 9 and 13
    assert growth_jump(read, 10, 3.0) == 3.0 / 1.5  # steps 0..9, not step 10 itself
    assert math.isnan(growth_jump(read, 30, 60.0)) and math.isnan(growth_jump([], 3, 2.0))
    assert math.isnan(growth_jump(read, 14, math.inf))


def _Figures(result, **changed):
    """A real measured step with some of its ladder's figures changed (the reader reads
    ``result.figures`` only)."""
    return dataclasses.replace(result, figures=dataclasses.replace(result.figures, **changed))


def test_the_reader_raises_each_kind_once_and_logs_1_while_it_holds_0_after():
    torch.manual_seed(0)
    result, _ = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    seen, said = [], []
    reader = FindingsReader(on_finding=seen.append, warn=said.append, owner="T")
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
    result, _ = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
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
    result, _ = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    big = _Figures(result, growth=50.0 * result.figures.growth)
    for on_finding, stops in ((lambda f: True, True), (lambda f: 1, False), (None, False)):
        reader = FindingsReader(on_finding=on_finding, warn=lambda _: None)
        assert reader.read(0, result).stop is False
        assert reader.read(5, big).stop is stops


def test_findings_warn_with_health_warning_and_a_failing_on_finding_is_said_once():
    torch.manual_seed(0)
    result, _ = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
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


# the eps comparisons EPS_COSTS reads: eps 0.1 against 1e-5 at GPT-2's init, paired seeds
EPS_COST_RECORDS = {
    "LayerNorm on the Python help text": "eps-compare-gpt2-init",
    "RMSNorm on the Python help text": "eps-law-oos/rms-4x128",
    "LayerNorm on the standard library's source": "eps-law-oos/python-source-4x128",
}


def test_the_eps_finding_cites_the_cost_measured_on_each_corpus():
    """The eps finding gives the measured costs, each the mean paired difference of its records,
    and says the size is the corpus's, not a figure for this run."""
    import json

    results = Path(__file__).resolve().parents[1] / "results"
    assert set(EPS_COST_RECORDS) == set(EPS_COSTS)
    for where, folder in EPS_COST_RECORDS.items():
        record = json.loads((results / folder / "results.json").read_text())
        recipe = record["runs"][0]["config"]["recipe"]
        assert recipe["init"] == "gpt2" and recipe["max_steps"] == 3000, where
        assert recipe["norm"] == ("rms" if where.startswith("RMSNorm") else "layer"), where
        assert ("source" in record["runs"][0]["data_name"]) == ("source" in where), where
        difference = record["differences"]["0.1"]
        assert difference["n"] >= 2 and round(difference["mean"], 4) == EPS_COSTS[where], where
    torch.manual_seed(0)
    # GPT-2's init at eps 0.1: the first norm reads var ~8e-4, eps/var ~130 (docs/eps.md)
    result, _ = _measured(TinyGPT(GPTConfig(depth=2, eps=0.1, init="gpt2")), torch.randint(0, 65, (4, 32)))
    value = step_signals(result.figures)["first_eps_over_var"]
    assert value > EPS_KNEE
    said = []
    finding = FindingsReader(warn=said.append).read(0, result).raised
    eps = [f for f in finding if f.kind == "eps_dominates"][0]
    assert eps.value == value and eps.message.endswith("More: docs/findings.md#eps_dominates.")
    assert len(eps.message) < 400 and "nats/char" not in eps.message  # short: the figures are in the docs
    for where, cost in EPS_COSTS.items():  # ... and in the long form the summary gives
        assert f"+{cost:.4f} nats/char with {where}" in long_form("eps_dominates")
    assert "the corpus's" in long_form("eps_dominates")


# the records EPS_DELAYS reads, each over its own schedule (docs/eps.md, "The cost as steps lost")
EPS_DELAY_RECORDS = {
    "LayerNorm on the Python help text": "eps-compare-gpt2-init",
    "LayerNorm on the Python help text, 1,000 steps": "eps-delay-1000",
    "LayerNorm on the standard library's source": "eps-law-oos/python-source-4x128",
    "LayerNorm on the standard library's source, 1,000 steps": "eps-delay-source-1000",
}


def test_the_eps_finding_cites_the_steps_each_configuration_lost():
    from lnmonitor.core.findings.reader import EPS_DELAYS
    from lnmonitor.experiments.eps.delay import delays

    results = Path(__file__).resolve().parents[1] / "results"
    assert set(EPS_DELAY_RECORDS) == set(EPS_DELAYS)
    for where, folder in EPS_DELAY_RECORDS.items():
        budget, median, low, high = EPS_DELAYS[where]
        steps = [d for d, _ in delays(results / folder, budgets=(budget - 1,))[budget - 1].values()]
        assert (round(statistics.median(steps)), round(min(steps)), round(max(steps))) == (median, low, high)
        said = f"{median:,} of {budget:,} steps ({low:,} to {high:,}) with {where}"
        assert said in long_form("eps_dominates")


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
    q = attn.qkv(h).split(32, dim=-1)[0].view(2, 8, 4, 8).transpose(1, 2)
    tap = ScaleTap()
    tap.start()
    module(x, x)
    tap.stop()
    k = attn.qkv(h).split(32, dim=-1)[1].view(2, 8, 4, 8).transpose(1, 2)
    expected = attention_logit_max(attn.q_norm(q), attn.k_norm(k), is_causal=True).item()
    assert tap.result().attention == [pytest.approx(expected, rel=1e-6)]


# ---------------------------------------------------------------------------
# no finding where nothing is wrong
# ---------------------------------------------------------------------------


def _families():
    compatibility = pytest.importorskip("test_compatibility")
    return compatibility, [pytest.param(f, id=f.key) for f in compatibility.FAMILIES]


@pytest.mark.parametrize("family", _families()[1])
def test_the_compatibility_families_at_their_defaults_raise_no_finding(family):
    """One measured step of each family of tests/test_compatibility.py (random weights, its
    default initialisation), read with the default thresholds: nothing is raised; the scales are
    taken on every family without failing."""
    compatibility = _families()[0]
    torch.manual_seed(0)
    module = compatibility.Wrapped(family.build(), family.hf)
    batch = next(iter(compatibility.data(0, None, family.decoder)))
    meter, tap = LadderMeter(module, say=lambda _: None, warn=lambda *_: None), ScaleTap()
    meter.start()
    tap.start()
    module.training_step(batch, 0).backward()
    tap.stop()
    meter.stop()
    said = []
    assert tap.result() is not None  # the testbed's scales (experiments.stability.scales): every family
    reading = FindingsReader(warn=said.append).read(0, meter.result())
    assert reading.raised == [] and said == [] and tap.error is None


# ---------------------------------------------------------------------------
# the three doors: one shared call each
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


def test_the_trainer_door_stops_through_control_when_on_finding_says_so(tmp_path):
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
    checkpoint come back from its trainer_state.json, where the door keeps each change of a health
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


def test_the_loop_door_sets_should_stop_and_logs_1_while_it_holds_0_after():
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
    from pathlib import Path

    from conftest import events

    examples = Path(__file__).resolve().parent.parent / "examples"
    proc = subprocess.run([sys.executable, str(examples / script[0]), *script[1:], "--steps", "3", "--out",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HealthWarning" not in proc.stderr
    tags = set(events(tmp_path / folder).Tags()["scalars"])
    assert any(t.startswith("lnmonitor/ladder/") for t in tags)
    assert not any(t.startswith("lnmonitor/health/") for t in tags)


# ---------------------------------------------------------------------------
# the messages quote the testbed's records (regenerated, never typed)
# ---------------------------------------------------------------------------

RESULTS = __import__("pathlib").Path(__file__).resolve().parent.parent / "results" / "stability"


def test_the_messages_quote_the_testbeds_records_and_the_thresholds_are_the_tested_ones():
    """stream_growth: its threshold the pre-registered one, its figures the confirmation part's, which
    passed the rule to ship; eps_dominates: the fitted testbed's."""
    from lnmonitor.core.findings.reader import TESTBED
    from lnmonitor.experiments.stability import heldout as H
    from lnmonitor.experiments.stability import heldout_table as T
    from lnmonitor.experiments.stability.candidate_signals import CANDIDATES
    from lnmonitor.experiments.stability.table import PEERS, analyse, load_records, signal_figures

    confirmed = T.judge_heldout(H.load(RESULTS.parent / "stability-confirm", H.CONFIRM_RUNS))
    assert len(confirmed) == len(H.CONFIRM_RUNS)
    stream = KINDS["stream_growth"]
    rule = f"growth_over_start > {stream.threshold:g}"
    assert rule in T.RULES and stream.signal == "growth_over_start"
    figures = T.figures(confirmed, rule, amended=True)
    assert TESTBED["stream_growth"] == figures
    assert T.ships(rule, figures)
    runs = analyse(load_records(RESULTS))
    eps = KINDS["eps_dominates"]
    assert CANDIDATES[eps.signal] == (eps.direction, eps.threshold)
    peers = max(signal_figures(runs, p)["hits"] for p in PEERS)
    assert TESTBED["eps_dominates"] == {**signal_figures(runs, eps.signal), "peer_hits": peers}


def test_the_default_recipe_raises_no_finding_in_the_testbed():
    """Evidence from the testbed's runs of the default recipe (lr 3e-3, one-cycle warm-up) at
    reduced steps and batch (300 steps, batch 16): no kind fires in any seed at its threshold."""
    from lnmonitor.experiments.stability import heldout_table as T
    from lnmonitor.experiments.stability.table import analyse, load_records

    records = load_records(RESULTS)
    runs = [r for r in analyse(records) if r.name == "lr3e-3"]
    assert runs and all(r.fires["first_eps_over_var"] is None for r in runs)
    judged = [r for r in T.judge_fitted(records) if r.name == "lr3e-3"]
    assert judged and all(r.fires["growth_over_start > 35"] is None for r in judged)


def test_a_testbed_run_records_every_step_and_the_command_tabulates_and_skips_it(tmp_path):
    from dataclasses import replace

    from lnmonitor.commands.cli import main
    from lnmonitor.experiments.stability import testbed as stability
    from lnmonitor.tiny.corpus import default_corpus

    config = stability.TESTBED["qk-lr3e-2-nowarmup"]
    small = replace(config.recipe, width=32, heads=2, depth=2, context=16, max_steps=12, val_every=6)
    stability.TESTBED["tiny-test"] = replace(config, name="tiny-test", recipe=small, seeds=(0,))
    try:
        text = default_corpus()[:20000]
        paths = stability.run_testbed(text, tmp_path, names=["tiny-test"], echo=lambda _: None)
        record = __import__("json").loads(paths[0].read_text())
        assert len(record["loss"]) == len(record["grad_norm"]) == 12 and record["steps"] == 12
        assert [m["step"] for m in record["measured"]] == [0, 5, 10]
        assert len(record["measured"][0]["attention_per_layer"]) == 2  # one per layer
        assert [v[0] for v in record["val"]] == [5, 11] and math.isfinite(record["final_val_loss"])
        said = []
        stability.run_testbed(text, tmp_path, names=["tiny-test"], echo=said.append)
        assert "tiny-test seed=0: finished before, skipped" in said
    finally:
        del stability.TESTBED["tiny-test"]
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- stability-table:start -->\nSTALE\n<!-- stability-table:end -->\ny\n")
    assert main(["stability-grid", "--out", str(tmp_path), "--table-only", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "STALE" not in text and "| tiny-test | 0 |" in text and text.endswith("-->\ny\n")
    assert main(["stability-grid", "--out", str(tmp_path / "empty"), "--table-only"]) == 2


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_testbed_shards_are_disjoint_cover_it_and_start_with_seed_zero(count):
    from lnmonitor.commands.cli import main
    from lnmonitor.experiments.stability.testbed import TESTBED, testbed_runs

    every = testbed_runs()
    assert sorted(every) == sorted((n, s) for n, c in TESTBED.items() for s in c.seeds)
    assert [s for _, s in every[:len(TESTBED)]] == [0] * len(TESTBED)  # seed 0 of each first
    shards = [testbed_runs(shard=(i, count)) for i in range(count)]
    assert sorted(r for shard in shards for r in shard) == sorted(every)  # disjoint and covering
    assert sum(map(len, shards)) == len(every)
    assert main(["stability-grid", "--shard", f"{count}/{count}", "--table-only"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("door", ["lightning", "trainer", "loop"])
def test_the_stop_on_finding_example_stops_each_door_at_its_first_finding(tmp_path, door):
    import re
    import subprocess
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    proc = subprocess.run([sys.executable, str(examples / "stop_on_finding.py"), "--door", door, "--out",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HealthWarning" in proc.stderr and "stream_growth" in proc.stdout
    trained = int(re.search(rf"{door}: trained (\d+) of 250 steps", proc.stdout).group(1))
    assert trained <= 10  # the lr-0.1 run stops at its first measured finding, not at step 250
