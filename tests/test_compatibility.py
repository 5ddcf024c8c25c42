"""The monitors unchanged, at their default arguments, on the models people train.

Each row builds a tiny random-weight model from a real class (transformers, LitGPT, a
nanoGPT-style model written as nanoGPT does), wraps it the usual way -- a LightningModule
without ``forward`` whose ``training_step`` returns the model's loss -- fits two steps
with ``LayerNormMonitor()`` and ``FinalNormInvarianceMonitor()``, and checks: every norm
found with its role, the final norm, the five invariance cases logged, and the step-0
statistics against an independent float64 recomputation whose gain formula comes from
the family's own definition (``weight``, or ``1 + weight`` for Gemma and LitGPT's unit
offset), not from lnmonitor's detection.  Dropout is off, so that the float64
recomputation sees the training step's forward.

``python tests/test_compatibility.py`` prints the README's compatibility table from the
same rows.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import warnings
from dataclasses import dataclass, field

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import qr_share
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.invariance import CASES
from lnmonitor.core.reductions import ROUNDING_ROW
from lnmonitor.core.summaries import SHARE_RESOLUTION, SIGMA_RESOLUTION

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 97, 16, 4
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)


# ---------------------------------------------------------------------------
# a nanoGPT-style model, written as nanoGPT writes it
# ---------------------------------------------------------------------------


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's: PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = LayerNorm(d, bias=False)
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
        self.ln_2 = LayerNorm(d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab=VOCAB, d=32, layers=2, heads=4, block=64):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
            h=nn.ModuleList(NanoBlock(d, heads) for _ in range(layers)), ln_f=LayerNorm(d, bias=False),
        ))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ---------------------------------------------------------------------------
# the rows
# ---------------------------------------------------------------------------


@dataclass
class Family:
    """One row: how to build the model, which modules are its norms (class names), what they
    compute (kind and gain, from the family's code), and the role each should get."""

    label: str
    build: object
    norm_classes: tuple[str, ...]
    kind: str
    unit_offset: bool = False  # gain = 1 + weight
    roles: dict[str, str] = field(default_factory=dict)  # glob -> role; the rest: "residual"
    hf: bool = True  # forward(input_ids=, labels=) returns .loss; else forward(idx) -> logits
    final: str = ""
    refused: str = ""  # a norm class left out, named in one message with the reason


def _hf(config_cls, **kw):
    def build():
        cfg = getattr(transformers, config_cls)(**kw)
        return transformers.AutoModelForCausalLM.from_config(cfg)
    return build


def _masked_lm(config_cls, **kw):
    def build():
        return transformers.AutoModelForMaskedLM.from_config(getattr(transformers, config_cls)(**kw))
    return build


def _litgpt(norm, name="tiny"):
    def build():
        from litgpt import GPT, Config

        return GPT(Config(name=name, n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=VOCAB,
                          padded_vocab_size=VOCAB, norm_class_name=norm, bias=False))
    return build


GEMMA3_ROLES = {"*.post_attention_layernorm": "post", "*.post_feedforward_layernorm": "post",
                "*.q_norm": "qk", "*.k_norm": "qk"}
FAMILIES = [
    Family("GPT-2", _hf("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
           ("LayerNorm",), "layer", final="model.transformer.ln_f"),
    Family("GPT-NeoX (parallel residual)", _hf(
        "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64), ("LayerNorm",), "layer",
        final="model.gpt_neox.final_layer_norm"),
    Family("Llama", _hf("LlamaConfig", **TINY), ("LlamaRMSNorm",), "rms", final="model.model.norm"),
    Family("Mistral", _hf("MistralConfig", **TINY), ("MistralRMSNorm",), "rms", final="model.model.norm"),
    Family("Phi-3", _hf("Phi3Config", **TINY), ("Phi3RMSNorm",), "rms", final="model.model.norm"),
    Family("Qwen3 (QK-norms)", _hf("Qwen3Config", **TINY, head_dim=8), ("Qwen3RMSNorm",), "rms",
           roles={"*.q_norm": "qk", "*.k_norm": "qk"}, final="model.model.norm"),
    Family("Gemma (1 + weight)", _hf("GemmaConfig", **TINY, head_dim=8), ("GemmaRMSNorm",), "rms",
           unit_offset=True, final="model.model.norm"),
    Family("Gemma 2 (post-sublayer norms)", _hf("Gemma2Config", **TINY, head_dim=8), ("Gemma2RMSNorm",),
           "rms", unit_offset=True, roles=GEMMA3_ROLES, final="model.model.norm"),
    Family("Gemma 3 (QK- and post-norms)", _hf("Gemma3TextConfig", **TINY, head_dim=8), ("Gemma3RMSNorm",),
           "rms", unit_offset=True, roles=GEMMA3_ROLES, final="model.model.norm"),
    Family("OLMo 2 (no pre-norm)", _hf("Olmo2Config", **TINY), ("Olmo2RMSNorm",), "rms",
           roles={"*.post_attention_layernorm": "post", "*.post_feedforward_layernorm": "post",
                  "*.q_norm": "qk", "*.k_norm": "qk"}, final="model.model.norm"),
    Family("Falcon (parallel)", _hf("FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4), ("LayerNorm",), "layer",
           final="model.transformer.ln_f"),
    Family("OPT", _hf("OPTConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64,
                      dropout=0.0, attention_dropout=0.0),
           ("LayerNorm",), "layer", final="model.model.decoder.final_layer_norm"),
    Family("LitGPT GPT, LayerNorm", _litgpt("LayerNorm"), ("LayerNorm",), "layer", hf=False,
           final="model.transformer.ln_f"),
    Family("LitGPT GPT, RMSNorm", _litgpt("RMSNorm"), ("RMSNorm",), "rms", hf=False,
           final="model.transformer.ln_f"),
    Family("LitGPT GPT, RMSNorm add_unit_offset", _litgpt("RMSNorm", "Gemma-tiny"), ("RMSNorm",), "rms",
           unit_offset=True, hf=False, final="model.transformer.ln_f"),
    Family("nanoGPT-style (hand-written LayerNorm)", NanoGPT, ("LayerNorm",), "layer", hf=False,
           final="model.transformer.ln_f"),
    # post-LN: each block's norms normalise the sum after the residual add; no gradient goes
    # around any of them, so there is no pre-norm ladder; the MLM head's norm is the last to run
    # before the logits (the final norm of the invariance probe), a ladder of one rung
    Family("BERT (post-LN, masked LM)", _masked_lm(
        "BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0), ("LayerNorm",), "layer",
        roles={"*.embeddings.LayerNorm": "embedding", "*.encoder.layer.*": "post"},
        final="model.cls.predictions.transform.LayerNorm"),
    Family("BLOOM (embedding norm)", _hf(
        "BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
        attention_dropout=0.0), ("LayerNorm",), "layer",
        roles={"*.word_embeddings_layernorm": "embedding"}, final="model.transformer.ln_f"),
    # the gated norm inside each mixer computes rmsnorm(x * silu(gate)) from forward(x, gate):
    # measured on x it logged sigma 0.155 against 0.044 true; it is left out and named
    Family("Mamba2 (gated norms left out)", _hf(
        "Mamba2Config", vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, num_heads=4,
        head_dim=16, expand=2, n_groups=1, chunk_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        ("Mamba2RMSNorm",), "rms", final="model.backbone.norm_f", refused="MambaRMSNormGated"),
]


class Wrapped(L.LightningModule):
    """The usual way: no forward; training_step returns the model's loss."""

    def __init__(self, model, hf: bool):
        super().__init__()
        self.model, self.hf = model, hf

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hf:
            return self.model(input_ids=x, labels=x).loss
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Capture(Callback):
    """The weights and the batch of step 0, before its update."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and not hasattr(self, "state"):
            self.state = copy.deepcopy(pl_module.state_dict())
            self.batch = [t.clone() for t in batch]


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, VOCAB, (8, SEQ), generator=g)
    y = torch.randint(3, VOCAB, (8, SEQ), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def reference(family: Family, module: Wrapped, state, batch) -> dict[str, dict]:
    """Independent float64 statistics of step 0: the family's norm modules by class name,
    their gain by the family's definition, shares by QR."""
    ref = copy.deepcopy(module)
    ref.load_state_dict(state)
    ref = ref.double()
    kept: dict[str, list] = {}
    norms = {n: m for n, m in ref.named_modules() if type(m).__name__ in family.norm_classes}
    for name, m in norms.items():
        def hook(mod, a, o, name=name):
            kept[name] = [a[0].detach()]
            o.register_hook(lambda g, name=name: kept[name].append(g.detach()))
        m.register_forward_hook(hook)
    with torch.enable_grad():
        ref.training_step(batch, 0).backward()
    out = {}
    for name, m in norms.items():
        x, g = kept[name]
        d = x.shape[-1]
        x, g = x.reshape(-1, d).numpy(), g.reshape(-1, d).numpy()
        weight = getattr(m, "weight", None)
        gain = None if weight is None else weight.detach().numpy() + (1.0 if family.unit_offset else 0.0)
        w = g if gain is None else g * gain
        # rows with (next to) no gradient carry no share: a shifted loss leaves the last position
        # empty, causal attention the query at position 0 (the contract's rule, in float64)
        size = np.linalg.norm(w, axis=1)
        informative = size > ROUNDING_ROW * np.sqrt(np.mean(size**2))
        var = x.var(1) if family.kind == "layer" else (x**2).mean(1)
        eps = next((float(getattr(m, a)) for a in ("eps", "variance_epsilon")
                    if getattr(m, a, None) is not None), 1e-5)  # nanoGPT's: 1e-5 in its forward
        out[name] = dict(share=qr_share(x[informative], w[informative], family.kind),
                         sigma=math.sqrt(np.median(var) + eps))
    return out


def run(family: Family) -> dict:
    """Fit two steps with both monitors at their defaults; return what the row reports."""
    torch.manual_seed(0)
    module = Wrapped(family.build(), family.hf)
    ln, inv = LayerNormMonitor(keep_history=True), FinalNormInvarianceMonitor(keep_history=True)
    capture = Capture()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        log_every_n_steps=1, limit_val_batches=1, callbacks=[ln, inv, capture])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data(0), data(1))
    return dict(module=module, ln=ln, inv=inv, capture=capture, trainer=trainer,
                warnings=[str(w.message) for w in caught])


def expected_role(family: Family, name: str) -> str:
    if name == family.final:
        return "final"
    return next((role for pattern, role in family.roles.items() if fnmatch.fnmatchcase(name, pattern)),
                "residual")


@pytest.mark.parametrize("family", FAMILIES, ids=[f.label for f in FAMILIES])
def test_both_monitors_at_their_defaults_against_float64(family):
    got = run(family)
    ln, inv, module = got["ln"], got["inv"], got["module"]
    assert got["trainer"].global_step == 2
    norms = [n for n, m in module.named_modules() if type(m).__name__ in family.norm_classes]
    assert sorted(n.name for n in ln.norms) == sorted(norms)  # every norm found, none refused
    assert all(n.kind == family.kind for n in ln.norms)
    assert {n.name: n.role for n in ln.norms} == {n: expected_role(family, n) for n in norms}
    assert [h["step"] for h in ln.history] == [0, 1]
    ref = reference(family, module, got["capture"].state, got["capture"].batch)
    shares = {n: np.median(r["share"]) for n, r in ref.items()}
    for name, r in ref.items():
        h = ln.history[0]
        assert abs(h[f"lnmonitor/share_median/{name}"] - shares[name]) <= 0.01, name
        assert h[f"lnmonitor/share_max/{name}"] == pytest.approx(r["share"].max(), abs=1e-4), name
        assert h[f"lnmonitor/sigma/{name}"] == pytest.approx(r["sigma"], rel=0.01), name
    rungs = [n.name for n in ln.norms if n.role in ("residual", "final")]
    assert ("lnmonitor/ladder/attenuation" in ln.history[0]) == (len(rungs) >= 2)
    # the invariance monitor: on, with its five cases, on the family's final norm
    assert inv.disabled_reason is None, inv.disabled_reason
    assert inv.last_result.final_norm == family.final
    h = inv.history[0]
    for case in CASES:
        assert f"lnmonitor/invariance/{case}/dloss" in h and f"lnmonitor/invariance/{case}/out_residual" in h
    assert abs(h["lnmonitor/invariance/axis_5/dloss"]) > 0
    if family.kind == "layer":
        assert h["lnmonitor/invariance/shift_5/dloss"] == 0.0
    assert abs(h["lnmonitor/invariance/scale_3/dloss"]) < 1e-3
    assert not any("Traceback" in w for w in got["warnings"])
    refusals = [w for w in got["warnings"] if "look like normalisation layers but are not measured" in w]
    assert len(refusals) == (2 if family.refused else 0)  # once per monitor
    assert all(f"{family.refused} (" in w and "more than the input it normalises (gate)" in w
               for w in refusals)


def matrix_row(family: Family) -> str:
    got = run(family)
    ln, inv = got["ln"], got["inv"]
    roles: dict[str, int] = {}
    for n in ln.norms:
        roles[n.role] = roles.get(n.role, 0) + 1
    gain = "1 + weight" if family.unit_offset else "weight"
    ref = reference(family, got["module"], got["capture"].state, got["capture"].batch)
    h = ln.history[0]
    dev = max(abs(h[f"lnmonitor/share_median/{n}"] - np.median(r["share"])) for n, r in ref.items())
    sig = max(abs(h[f"lnmonitor/sigma/{n}"] / r["sigma"] - 1) for n, r in ref.items())
    role_text = ", ".join(f"{roles[k]} {k}" for k in ("residual", "final", "qk", "embedding", "post")
                          if k in roles)
    on = "on, 5 cases" if inv.disabled_reason is None else "off"
    return (f"| {family.label} | {len(ln.norms)} {family.kind}, gain {gain} | {role_text} | "
            f"`{inv.last_result.final_norm.removeprefix('model.')}` | {on} | "
            f"median share {dev:.1e}, sigma {sig:.1e} |")


if __name__ == "__main__":
    print(f"share resolution {SHARE_RESOLUTION:.1e}, sigma resolution {SIGMA_RESOLUTION:.1e}")
    print("| model | norms found | roles | final norm | invariance (defaults) | worst gap to float64 |")
    print("|---|---|---|---|---|---|")
    for fam in FAMILIES:
        print(matrix_row(fam))
