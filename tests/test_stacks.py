"""An encoder-decoder has two residual streams: each stack (its norms under ``encoder``, and
under ``decoder``) is its own 1/sigma ladder with its own final norm, through the meter on
T5, BART (post-LN) and Whisper with random weights; the encoder's attenuation against an
independent float64 computation; models with one stack keep their one ladder."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.meter.row_stats import SIGMA_RESOLUTION
from lnmonitor.core.norms.find import find_norms
from lnmonitor.core.norms.roles import assign_roles, expected_final, stack_of
from lnmonitor.views.summary import summary_text

transformers = pytest.importorskip("transformers")

VOCAB = 97


def t5() -> nn.Module:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def bart() -> nn.Module:
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(cfg)


def whisper() -> nn.Module:
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                                     max_target_positions=32, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1)
    return transformers.WhisperForConditionalGeneration(cfg)


def inputs(family: str) -> dict:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(3, VOCAB, (4, 10), generator=g)
    if family == "whisper":
        return {"input_features": torch.randn(4, 8, 32, generator=g), "labels": labels}
    return {"input_ids": torch.randint(3, VOCAB, (4, 12), generator=g), "labels": labels}


def measured(family: str):
    torch.manual_seed(0)
    model = {"t5": t5, "bart": bart, "whisper": whisper}[family]()
    said: list[str] = []
    meter = LadderMeter(model, info=said.append)
    batch = inputs(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.step():
            model(**batch).loss.backward()
        result = meter.result()
    return model, batch, meter, result, said + [str(w.message) for w in caught]


def sigma64(model: nn.Module, batch: dict, names: list[str]) -> dict[str, float]:
    """Per norm, in a float64 copy: ``sqrt(median over rows of v + eps)``, ``v`` the row's
    variance (LayerNorm) or mean square (T5's RMS norm), read from the module's own code."""
    ref = copy.deepcopy(model).double()
    seen: dict[str, torch.Tensor] = {}
    for name in names:
        ref.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: seen.__setitem__(name, a[0].detach()))
    with torch.no_grad():
        ref(**{k: v.double() if v.is_floating_point() else v for k, v in batch.items()})
    out = {}
    for name in names:
        module, x = ref.get_submodule(name), seen[name].reshape(-1, seen[name].shape[-1]).numpy()
        rms = type(module).__name__ == "T5LayerNorm"
        v = (x**2).mean(1) if rms else x.var(1)
        eps = module.variance_epsilon if rms else module.eps
        out[name] = math.sqrt(np.median(v) + eps)
    return out


def ladder_of(names: list[str], prefix: str) -> list[str]:
    return [n for n in names if n.startswith(prefix)]


@pytest.mark.parametrize("family", ["t5", "whisper"])
def test_a_pre_ln_encoder_decoder_has_one_ladder_per_stack(family):
    model, batch, meter, result, said = measured(family)
    enc, dec = ("encoder", "decoder") if family == "t5" else ("model.encoder", "model.decoder")
    enc_final, dec_final = ((f"{enc}.final_layer_norm", f"{dec}.final_layer_norm") if family == "t5"
                            else (f"{enc}.layer_norm", f"{dec}.layer_norm"))
    order = meter.order
    roles = {n.name: n.role for n in result.norms}
    # each stack's norms in forward order, its own final norm last (T5's encoder.final_layer_norm
    # ends the encoder's ladder: it is no branch norm)
    assert roles[enc_final] == roles[dec_final] == "final"
    assert all(roles[n] == "residual" for n in order if n not in (enc_final, dec_final))
    figures = result.figures
    assert figures.rungs == ladder_of(order, f"{dec}.") and figures.rungs[-1] == dec_final
    assert figures.final == dec_final == expected_final(find_norms(model))  # before a step, too
    assert [(s.stack, s.rungs, s.final) for s in figures.other_ladders] == [
        (enc, ladder_of(order, f"{enc}."), enc_final)]
    # the encoder's attenuation and growth under its own names, the decoder's under the plain ones
    sigma = sigma64(model, batch, order)
    m = result.metrics(positions=True)
    enc_rungs, dec_rungs = figures.other_ladders[0].rungs, figures.rungs
    for name, rungs in ((f"lnmonitor/ladder/{enc}/attenuation", enc_rungs),
                        ("lnmonitor/ladder/attenuation", dec_rungs)):
        assert m[name] == pytest.approx(sigma[rungs[-1]] / sigma[rungs[0]], rel=2 * SIGMA_RESOLUTION), name
    assert f"lnmonitor/ladder/{enc}/growth" in m and "lnmonitor/ladder/growth" in m
    assert not any(k.startswith(f"lnmonitor/ladder/{dec}/") for k in m)
    # positions: the encoder's rungs, then the decoder's
    assert [m[f"lnmonitor/ladder_position/{n}"] for n in order] == list(range(len(order)))
    # the message names each stack's ladder once
    ladders = [s for s in said if "stacks, each its own residual stream and ladder" in s]
    assert len(ladders) == 1
    assert f"{enc!r} has {len(enc_rungs)} rungs" in ladders[0] and f"final norm {enc_final!r}" in ladders[0]
    assert f"{dec!r}, the model's ladder" in ladders[0] and f"final norm {dec_final!r}" in ladders[0]
    assert f"lnmonitor/ladder/{enc}/..." in ladders[0]


def test_a_post_ln_encoder_decoder_has_a_final_norm_per_stack_and_no_pre_norm_ladder():
    """BART normalises after each residual add: no gradient goes around any norm. Each stack's
    last norm to run is its final norm (the encoder's output, read by cross-attention alone);
    neither stack has a ladder, and the warning says so for both."""
    model, batch, meter, result, said = measured("bart")
    roles = {n.name: n.role for n in result.norms}
    finals = {"model.encoder.layers.1.final_layer_norm", "model.decoder.layers.1.final_layer_norm"}
    assert {n for n, r in roles.items() if r == "final"} == finals
    assert {n for n, r in roles.items() if r == "embedding"} == {
        "model.encoder.layernorm_embedding", "model.decoder.layernorm_embedding"}
    assert all(r == "post" for n, r in roles.items() if "layers" in n and n not in finals)
    assert result.figures.final == "model.decoder.layers.1.final_layer_norm"
    # before a step (the HPARAMS columns), module order ends with the decoder's embedding norm: not it
    assert find_norms(model)[-1].name == "model.decoder.layernorm_embedding"
    assert expected_final(find_norms(model)) == result.figures.final
    assert [(s.stack, s.rungs) for s in result.figures.other_ladders] == [
        ("model.encoder", ["model.encoder.layers.1.final_layer_norm"])]
    assert not any(k.startswith("lnmonitor/ladder/") for k in result.metrics())
    warned = [s for s in said if "rung(s)" in s]
    assert len(warned) == 1 and "post-LN" in warned[0]
    assert "'model.encoder' has 1 rung(s)" in warned[0] and "'model.decoder' has 1 rung(s)" in warned[0]


def test_a_decoder_only_model_keeps_its_one_ladder():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=16)
    model, said = transformers.LlamaForCausalLM(cfg), []
    meter = LadderMeter(model, info=said.append)
    x = torch.randint(0, VOCAB, (4, 16))
    with meter.step():
        model(input_ids=x, labels=x).loss.backward()
    result = meter.result()
    assert result.figures.other_ladders == () and set(meter.stack_of.values()) == {""}
    assert result.figures.rungs[0] == "model.layers.0.input_layernorm"
    assert result.figures.final == "model.norm"
    ladder = {k for k in result.metrics() if k.startswith("lnmonitor/ladder/")}
    assert ladder == {"lnmonitor/ladder/attenuation", "lnmonitor/ladder/growth"}
    assert any(s.startswith("LadderMeter: the ladder has 5 rungs") for s in said)


def test_stacks_from_module_names():
    # one encoder or decoder module (OPT's decoder, BERT's encoder): one stack
    opt = ["model.decoder.layers.0.self_attn_layer_norm", "model.decoder.final_layer_norm"]
    assert stack_of(opt) == dict.fromkeys(opt, "")
    bert = ["bert.embeddings.LayerNorm", "bert.encoder.layer.0.output.LayerNorm",
            "cls.predictions.transform.LayerNorm"]
    assert stack_of(bert) == dict.fromkeys(bert, "")
    # the first encoder/decoder component names the stack (a ViT encoder inside an encoder)
    names = ["encoder.encoder.layer.0.layernorm_before", "encoder.layernorm", "decoder.h.0.ln_1",
             "decoder.ln_f"]
    assert list(stack_of(names).values()) == ["encoder", "encoder", "decoder", "decoder"]
    # a norm outside both: the stack sharing most of its path, else the one that ran just before
    names = ["text.encoder.layers.0.ln", "text.final_ln", "vision.pre_ln", "vision.encoder.layers.0.ln",
             "head_ln"]
    assert list(stack_of(names).values()) == [
        "text.encoder", "text.encoder", "vision.encoder", "vision.encoder", "vision.encoder"]


def test_roles_per_stack_with_and_without_ladder_patterns():
    model = nn.Module()
    model.encoder = nn.ModuleList(nn.LayerNorm(8) for _ in range(3))
    model.decoder = nn.ModuleList(nn.LayerNorm(8) for _ in range(3))
    norms = find_norms(model)
    bypass = dict(zip([n.name for n in norms], [0.9, 0.9, 0.0, 0.9, 0.9, 0.0], strict=True))
    assert [n.role for n in assign_roles(norms, bypass)] == ["residual", "residual", "final"] * 2
    # named rungs: each stack's last is its final norm
    named = assign_roles(norms, bypass, ladder=["encoder.0", "encoder.1", "decoder.*"])
    assert [n.role for n in named] == ["residual", "final", "post", "residual", "residual", "final"]
    # final_norm names the final norm of its stack; the other stack finds its own
    assert [n.role for n in assign_roles(norms, {**bypass, "decoder.1": 0.0}, final_norm="decoder.1")] == [
        "residual", "residual", "final", "residual", "final", "post"]


def test_the_summary_gives_each_stacks_ladder():
    p, word = "lnmonitor", "(1/sigma of the first rung / the last)"
    curves = {
        f"{p}/inv_sigma/model.encoder.ln": [(0, 2.0), (5, 2.0)],
        f"{p}/inv_sigma/model.decoder.ln": [(0, 1.0), (5, 1.0)],
        f"{p}/ladder/attenuation": [(0, 1.9), (5, 2.0)],
        f"{p}/ladder/model.encoder/attenuation": [(0, 1.7), (5, 1.6)],
        f"{p}/ladder/model.encoder/growth": [(0, 1.4), (5, 1.5)],
    }
    text = summary_text(curves)
    assert f"attenuation of the model's ladder {word}: 2x, 1.9x at step 0" in text
    assert f"attenuation of model.encoder's ladder {word}: 1.6x, 1.7x at step 0" in text
    assert "growth of model.encoder's ladder (rms of the last rung / the first): 1.5x, 1.4x at step 0" in text
    one = {k: v for k, v in curves.items() if "model.encoder/" not in k}
    assert f"  attenuation {word}: 2x, 1.9x at step 0" in summary_text(one)


def t5_padded(decoder_mask: bool) -> tuple[nn.Module, dict]:
    """T5 with source and target of the same length (the rows of both stacks fit either mask),
    the last half of every source padded, and, with ``decoder_mask``, the last 4 of every target."""
    torch.manual_seed(0)
    model = t5()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(3, VOCAB, (4, 10), generator=g), torch.randint(3, VOCAB, (4, 10), generator=g)
    source = torch.ones(4, 10, dtype=torch.long)
    source[:, 5:] = 0
    batch = {"input_ids": ids.masked_fill(source == 0, 0), "attention_mask": source}
    if decoder_mask:
        target = torch.ones(4, 10, dtype=torch.long)
        target[:, 6:] = 0
        batch["decoder_attention_mask"] = target
        labels = labels.masked_fill(target == 0, -100)
    return model, {**batch, "labels": labels}


@pytest.mark.parametrize("decoder_mask", [True, False], ids=["decoder_attention_mask", "encoder mask only"])
def test_each_stack_takes_its_own_padding(decoder_mask):
    # the encoder's attention_mask once masked the decoder's rows too (same row count): 20 of
    # the decoder's 40 real rows were left out of every statistic
    model, batch = t5_padded(decoder_mask)
    meter = LadderMeter(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.step():
            model(**batch).loss.backward()
        result = meter.result()
    said = [str(w.message) for w in caught]
    pads = {n.name: s.pad_rows for n, s in zip(result.norms, result.row_stats, strict=True)}
    assert all(p == 20 for n, p in pads.items() if n.startswith("encoder."))
    assert all(p == (16 if decoder_mask else 0) for n, p in pads.items() if n.startswith("decoder."))
    unknown = [s for s in said if "not the decoder's (no decoder_attention_mask)" in s]
    assert len(unknown) == (0 if decoder_mask else 1)
    # sigma of every norm against float64 on its own stack's real rows
    ref = copy.deepcopy(model).double()
    seen: dict[str, torch.Tensor] = {}
    for n in pads:
        ref.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, a[0].detach()))
    with torch.no_grad():
        ref(**batch)
    keep = {"encoder": batch["attention_mask"].reshape(-1) != 0,
            "decoder": batch.get("decoder_attention_mask", torch.ones(4, 10)).reshape(-1) != 0}
    m = result.metrics()
    for n in pads:
        x = seen[n].reshape(-1, 32)[keep[n.split(".")[0]]]
        eps = ref.get_submodule(n).variance_epsilon
        want = math.sqrt(np.median(x.square().mean(1).numpy()) + eps)
        assert m[f"lnmonitor/sigma/{n}"] == pytest.approx(want, rel=SIGMA_RESOLUTION), n
