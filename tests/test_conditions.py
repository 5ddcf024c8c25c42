"""The conditions people fine-tune under, through the meter (so through every monitor): padded
batches, frozen embeddings and norms (LoRA-like), bfloat16, a step without a backward and a
diverged loss.  Each number against an independent float64 computation on the real tokens."""

from __future__ import annotations

import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import gpt
from torch import nn

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.core.meter.row_stats import SIGMA_RESOLUTION
from lnmonitor.core.norms.find import find_norms

transformers = pytest.importorskip("transformers")

ROWS, CONTEXT, VOCAB = 8, 16, 64


def llama(**config) -> torch.nn.Module:
    """A tiny transformers Llama with random weights; pad token 0 (its embedding row is zero)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=CONTEXT, pad_token_id=0, **config)
    return transformers.LlamaForCausalLM(cfg)


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def padded_batch(side: str = "right") -> dict:
    """Half the tokens are padding: each row keeps 2..14 real tokens, the rest pad id 0."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, CONTEXT), generator=g)
    lengths = torch.tensor([2, 14, 4, 12, 6, 10, 8, 8])
    keep = torch.arange(CONTEXT)[None, :] < lengths[:, None]
    if side == "left":
        keep = keep.flip(1)
    ids = torch.where(keep, ids, 0)
    return {"input_ids": ids, "attention_mask": keep.long(), "labels": torch.where(keep, ids, -100)}


def forward_reference(model, batch, keep: torch.Tensor | None) -> dict[str, float]:
    """Per norm, in float64 on the kept rows (all when ``keep`` is None): the median sigma
    ``sqrt(v + eps)``."""
    ref = model.double() if next(model.parameters()).dtype != torch.float64 else model
    inputs: dict[str, torch.Tensor] = {}

    def keep_input(name):
        def hook(module, args, output):  # returns None: the output is left as it is
            inputs.setdefault(name, args[0].detach())
        return hook

    handles = [info.module.register_forward_hook(keep_input(info.name)) for info in find_norms(ref)]
    with torch.no_grad():
        ref(**batch)
    for h in handles:
        h.remove()
    out = {}
    for info in find_norms(ref):
        x = inputs[info.name].reshape(-1, inputs[info.name].shape[-1])
        if keep is not None:
            x = x[keep.reshape(-1)]
        v = x.var(-1, unbiased=False) if info.kind == "layer" else x.square().mean(-1)
        v = v[v > 0]  # a constant row (a zero pad embedding) has no sigma: no statistic counts it
        out[info.name] = math.sqrt(float(v.median() if v.numel() % 2 else np.median(v.numpy())) + info.eps())
    return out


def measured(model, batch, **meter_kw):
    meter = LadderMeter(model, **meter_kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.step():
            model(**batch).loss.backward()
        result = meter.result()
    model.zero_grad(set_to_none=True)
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_is_left_out_of_every_statistic(side):
    """Llama (zero pad embedding), half the tokens padding: sigma on the real tokens within
    the histogram's resolution; measured on every row it is far off (the bias this fixes)."""
    model, batch = llama(), padded_batch(side)
    keep = batch["attention_mask"].bool()
    result, said = measured(model, batch)
    real = forward_reference(llama(), batch, keep)
    everything = forward_reference(llama(), batch, None)
    m = result.metrics()
    for name, sigma in real.items():
        assert m[f"lnmonitor/sigma/{name}"] == pytest.approx(sigma, rel=SIGMA_RESOLUTION + 1e-6), name
    pads = int((~keep).sum())
    assert all(s.pad_rows == pads and s.rows == ROWS * CONTEXT for s in result.row_stats)
    assert all(s.skipped_rows < pads for s in result.row_stats)  # padding is not counted as skipped
    assert sum("attention_mask marks padding" in w for w in said) == 1
    # the condition matters: right-padded rows attend to the real tokens before them, so on
    # every row the second layer's first norm reads ~half the sigma (left-padded rows attend
    # to nothing and stay zero, a constant row no statistic counts)
    name = "model.layers.1.input_layernorm"
    assert (everything[name] < 0.8 * real[name]) == (side == "right")
    unmasked, _ = measured(llama(), batch, row_mask=False)
    logged = unmasked.metrics()[f"lnmonitor/sigma/{name}"]
    assert logged == pytest.approx(everything[name], rel=SIGMA_RESOLUTION + 1e-6)


def test_a_row_mask_of_ones_changes_nothing_and_a_callable_mask_is_used():
    model, batch = gpt2(), padded_batch()
    full = dict(batch, attention_mask=torch.ones_like(batch["attention_mask"]))
    a, _ = measured(model, full)
    b, _ = measured(gpt2(), full, row_mask=False)
    assert a.metrics() == b.metrics()
    keep = batch["attention_mask"].bool()
    c, said = measured(gpt2(), {k: v for k, v in batch.items() if k != "attention_mask"},
                       row_mask=lambda inputs: inputs["labels"] != -100)
    real = forward_reference(gpt2(), batch, keep)
    assert c.metrics()["lnmonitor/sigma/transformer.ln_f"] == pytest.approx(real["transformer.ln_f"],
                                                                          rel=SIGMA_RESOLUTION + 1e-6)
    assert any("row_mask marks padding" in w for w in said)


def test_frozen_embeddings_and_norms_keep_the_ladder():
    """Only the attention projections train (as with LoRA on q/v): the first norm gets no
    gradient, yet its sigma is measured from the forward, the ladder's attenuation is logged,
    and its shares are absent with the reason said once."""
    model = gpt2()
    for name, p in model.named_parameters():
        p.requires_grad_("attn.c_attn" in name)
    batch = {k: v for k, v in padded_batch().items() if k != "attention_mask"}
    batch["labels"] = batch["input_ids"]
    result, said = measured(model, batch)
    m = result.metrics()
    first = "transformer.h.0.ln_1"
    real = forward_reference(gpt2(), batch, None)
    assert m[f"lnmonitor/sigma/{first}"] == pytest.approx(real[first], rel=SIGMA_RESOLUTION + 1e-6)
    assert f"lnmonitor/share_median/{first}" not in m
    assert "lnmonitor/ladder/attenuation" in m and result.figures.rungs[0] == first
    assert "lnmonitor/share_median/transformer.h.0.ln_2" in m  # it gets gradient through c_attn
    assert sum("no gradient reaches" in w and first in w for w in said) == 1
    assert not any("did not run with gradient" in w for w in said)


class _Causal(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _roles(model, precision: str) -> list[tuple[str, str]]:
    monitor = LayerNormMonitor(every_n_steps=1, images=False, summary=False, keep_history=True)
    batch = padded_batch()
    data = [{k: v[i] for k, v in batch.items()} for i in range(ROWS)]
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[monitor], accelerator="cpu",
                        precision=precision)
    trainer.fit(_Causal(model), torch.utils.data.DataLoader(data, batch_size=ROWS))
    return [(n.name, n.role) for n in monitor.norms]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_roles_are_the_float32_roles_under_bf16_true(family):
    """A bfloat16 gradient rounds at 2^-8: what goes around a norm is measured to about that,
    so the tolerance scales with the gradient's dtype and a branch or final norm stays one."""
    build = llama if family == "llama" else gpt2
    assert _roles(build(), "bf16-true") == _roles(build(), "32-true")
    if family == "llama":
        assert ("model.model.norm", "final") in _roles(build(), "bf16-true")


def test_a_step_without_backward_logs_nothing_and_says_why():
    model = gpt()
    meter = LadderMeter(model)
    x = torch.randint(0, 10, (2, 8))
    with meter.step():
        model(x, x)  # no backward: the training step returned no loss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert meter.result(label="step 5") is None
    assert not any("torch.compile" in str(w.message) for w in caught)


def test_a_diverged_loss_is_said_and_the_invariance_monitor_stays_on():
    module = gpt()
    x = torch.randint(0, 10, (4, 8))
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, probe_batch=(x, x), keep_history=True,
                                     summary=False)
    with torch.no_grad():
        module.model.head.weight.fill_(float("nan"))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[inv], accelerator="cpu", limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=4))
    said = [str(w.message) for w in caught if "FinalNormInvarianceMonitor" in str(w.message)]
    assert any("the loss on the probe rows is nan" in w for w in said), said
    assert inv.history == [] and inv.off_reason is None


class _Looped(torch.nn.Module):
    """One pre-norm block applied three times (ALBERT's sharing), then a final norm."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.mix, self.mlp = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.lnf, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(3):
            h = h + self.mix(self.ln1(h))
            h = h + self.mlp(self.ln2(h))
        return self.head(self.lnf(h))


def test_a_norm_called_more_often_than_the_others_is_kept_out_of_the_ladder():
    """A looped block's norms pool three depths: they are named, once, and are no rungs;
    every call's rows are measured (3 x the final norm's)."""
    torch.manual_seed(0)
    model, x = _Looped(), torch.randint(0, VOCAB, (4, CONTEXT))
    meter = LadderMeter(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.step():
            model(x).square().mean().backward()
        result = meter.result()
    said = [str(w.message) for w in caught if "more often than the other norms" in str(w.message)]
    assert len(said) == 1 and "ln1" in said[0] and "ln2" in said[0]
    rows = {info.name: s.rows for info, s in zip(result.norms, result.row_stats, strict=True)}
    assert rows == {"ln1": 3 * 4 * CONTEXT, "ln2": 3 * 4 * CONTEXT, "lnf": 4 * CONTEXT}
    positions = result.figures.positions()
    assert positions["lnmonitor/ladder_position/ln1"] == positions["lnmonitor/ladder_position/ln2"] == -1
    assert "lnmonitor/ladder/attenuation" not in result.metrics()  # one rung left: no ladder


def bert() -> nn.Module:
    """A tiny BERT masked LM (post-LN), seeded random weights, no dropout."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=CONTEXT,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def test_a_post_ln_model_is_said_to_have_no_pre_norm_ladder():
    """BERT normalises each sublayer's output after the residual add: no norm reads a stream
    that flows on past it, so there is no 1/sigma ladder to log, and the message says why."""
    model = bert()
    x = torch.randint(1, VOCAB, (4, CONTEXT))
    told: list[str] = []
    meter = LadderMeter(model, info=told.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.step():
            model(input_ids=x, labels=x).loss.backward()
        result = meter.result()
    said = [str(w.message) for w in caught if "rung(s)" in str(w.message)]
    assert len(said) == 1 and "post-LN" in said[0]
    # the MLM head's norm is the final norm (the last before the logits), the ladder's one rung,
    # and not said to read a residual stream: no norm's input flows on past it
    ladder = [t for t in told if "the ladder has" in t]
    assert len(ladder) == 1 and "read the residual stream" not in ladder[0]
    assert "1 rung, its final norm 'cls.predictions.transform.LayerNorm' alone" in ladder[0]
    assert "lnmonitor/ladder/attenuation" not in result.metrics()
    assert "lnmonitor/sigma/bert.encoder.layer.0.output.LayerNorm" in result.metrics()


def test_a_frozen_embedding_norm_keeps_its_role():
    """No gradient reaches BERT's embedding LayerNorm when the embeddings are frozen: what goes
    around it cannot be measured, and it was then taken for a residual-stream rung."""
    model = bert()
    model.bert.embeddings.requires_grad_(False)
    x = torch.randint(1, VOCAB, (4, CONTEXT))
    meter = LadderMeter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with meter.step():
            model(input_ids=x, labels=x).loss.backward()
        result = meter.result()
    roles = {n.name: n.role for n in result.norms}
    assert roles["bert.embeddings.LayerNorm"] == "embedding"
    assert "lnmonitor/share_median/bert.embeddings.LayerNorm" not in result.metrics()  # no gradient
    assert "lnmonitor/sigma/bert.embeddings.LayerNorm" in result.metrics()  # its forward


class PooledHead(nn.Module):
    """A token norm, then a norm of the mean-pooled sequence: one row per sequence, which a
    (batch, tokens) padding mask does not line up with."""

    def __init__(self):
        super().__init__()
        self.emb, self.tokens, self.pooled = nn.Embedding(VOCAB, 16), nn.LayerNorm(16), nn.LayerNorm(16)
        self.out = nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask, labels):
        h = self.tokens(self.emb(input_ids))
        logits = self.out(self.pooled(h.mean(1)))
        return F.cross_entropy(logits, labels)


def test_a_norm_the_padding_mask_does_not_fit_is_said_and_counts_every_row():
    torch.manual_seed(0)
    model = PooledHead()
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[:, 5:] = 0
    batch = {"input_ids": torch.randint(0, VOCAB, (4, 8)), "attention_mask": mask,
             "labels": torch.tensor([0, 1, 2, 0])}
    meter = LadderMeter(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.step():
            model(**batch).backward()
        result = meter.result()
    pads = {n.name: (s.rows, s.pad_rows) for n, s in zip(result.norms, result.row_stats, strict=True)}
    assert pads == {"tokens": (32, 12), "pooled": (4, 0)}
    said = [str(w.message) for w in caught if "does not line up with the rows of pooled" in str(w.message)]
    assert len(said) == 1 and "count every row, padding included" in said[0]


def test_a_row_mask_that_raises_is_said_once_and_training_goes_on():
    def broken(inputs):
        raise KeyError("no such field")

    model, batch = gpt2(), padded_batch()
    result, said = measured(model, batch, row_mask=broken)
    assert result is not None and all(s.pad_rows == 0 for s in result.row_stats)
    assert sum("the row mask failed (KeyError" in w for w in said) == 1
