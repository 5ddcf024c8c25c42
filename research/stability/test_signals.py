"""research.stability.scales and candidate_signals: the attention and output logits against
float64, and every candidate signal of a measured step, the findings' own among them."""

from __future__ import annotations

import math

import pytest
import torch

from lnmonitor.core.findings.signals import step_signals
from lnmonitor.core.hooks import unmeasured
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from research.stability import heldout
from research.stability.candidate_signals import STEP_SIGNALS, candidate_signals, growth_jump, growth_rate
from research.stability.scales import ScaleTap, attention_logit_max, output_logit_scales


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


def _measured(model, x):
    meter, tap = LadderMeter(model, info=lambda _: None), ScaleTap()
    meter.start()
    tap.start()
    model(x, x)[1].backward()
    tap.stop()
    meter.stop()
    return meter.result(), tap.result()


def test_candidate_signals_are_the_meters_figures_and_the_findings_own():
    torch.manual_seed(0)
    result, scales = _measured(TinyGPT(GPTConfig(depth=2)), torch.randint(0, 65, (4, 32)))
    s = candidate_signals(result.figures, scales)
    f = result.figures
    by = f.by_name()
    assert list(s) == list(STEP_SIGNALS) and step_signals(f).items() <= s.items()
    assert s["growth"] == f.growth and s["attenuation"] == f.attenuation
    assert s["inv_sigma_first"] == by[f.rungs[0]].inv_sigma and s["inv_sigma_last"] == by["lnf"].inv_sigma
    assert s["first_eps_over_var"] == by[f.rungs[0]].eps_over_var
    assert s["final_share_max"] == by["lnf"].stats.share_max
    assert s["attention_max"] == max(scales.attention) and s["z_mean"] == scales.z_mean
    assert math.isnan(candidate_signals(f)["attention_max"])
    assert all(math.isnan(v) for v in candidate_signals(None).values())
    assert growth_rate((10, 2.0), 20, 20.0) == pytest.approx(0.1)
    assert math.isnan(growth_rate(None, 20, 20.0)) and math.isnan(growth_rate((20, 2.0), 20, 3.0))


def test_the_vanished_share_is_the_largest_over_norms_of_rows_whose_gradient_vanished():
    """The second block's input passes no gradient back at 10 of 16 positions: the first
    block's norms lost it on 40 of 64 rows where the final norm has one."""
    torch.manual_seed(0)
    model, x = TinyGPT(GPTConfig(width=32, depth=2, heads=2, context=16)), torch.randint(0, 65, (4, 16))
    keep = torch.arange(16) < 6
    handle = model.blocks[1].register_forward_pre_hook(
        lambda module, args: (torch.where(keep[:, None], args[0], args[0].detach()),))
    meter = LadderMeter(model, info=lambda _: None, warn=lambda *_: None)
    with meter.step():
        model(x, x)[1].backward()
    handle.remove()
    assert candidate_signals(meter.result().figures)["vanished_share"] == 40 / 64


def test_growth_jump_is_the_growth_over_its_least_value_in_the_ten_steps_before():
    read = [(0, 2.0), (5, 1.5), (9, 4.0), (12, math.nan), (13, 3.0)]
    assert growth_jump(read, 14, 60.0) == 60.0 / 1.5  # steps 4..13: 5, 9, 13 (nan is no value)
    assert growth_jump(read, 16, 60.0) == 60.0 / 3.0  # steps 6..15: 9 and 13
    assert growth_jump(read, 10, 3.0) == 3.0 / 1.5  # steps 0..9, not step 10 itself
    assert math.isnan(growth_jump(read, 30, 60.0)) and math.isnan(growth_jump([], 3, 2.0))
    assert math.isnan(growth_jump(read, 14, math.inf))


def test_the_scale_tap_reads_qk_normed_queries_and_keys():
    from lnmonitor.tiny.module import TinyGPTModule

    torch.manual_seed(0)
    module = TinyGPTModule("abcdefgh", width=32, depth=1, heads=4, context=8, qk_norm=True, z_loss=1e-2,
                           schedule="constant")
    x = torch.randint(0, 8, (2, 8))
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


@pytest.mark.parametrize("family", ["torch-nn", "hf-gpt2", "hf-llama", "tiny-deep"])
def test_the_scale_tap_takes_the_scales_on_every_held_out_family_without_failing(family):
    """torch.nn's attention is not scaled_dot_product_attention: no attention logits there."""
    if family.startswith("hf-"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = heldout.build(family)
    x, y = next(heldout.batches(heldout.corpus("help")[:10_000], 0))
    tap = ScaleTap()
    tap.start()
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    tap.stop()
    scales = tap.result()
    assert tap.error is None and math.isfinite(scales.logit_max)
    assert bool(scales.attention) == (family != "torch-nn")
