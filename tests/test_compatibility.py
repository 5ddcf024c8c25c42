"""The monitors unchanged, at their default arguments, on the models people train, under the
conditions they train them: a grid of families x conditions.

Each row (a :class:`Family`) builds a tiny random-weight model from a real class
(transformers, LitGPT, a nanoGPT-style model written as nanoGPT does), wraps it the usual
way -- a LightningModule without ``forward`` whose ``training_step`` returns the model's
loss -- and each column (a :class:`Condition`) changes one thing: the precision, padding, what
trains (attention projections only, or a peft LoRA), gradient checkpointing.  Every cell
fits two steps with ``LayerNormMonitor()`` and ``FinalNormInvarianceMonitor()`` and checks
every norm found with the role it has under float32, and the step-0 statistics against an
independent float64 recomputation on the real tokens whose gain formula comes from the
family's own definition (``weight``, or ``1 + weight`` for Gemma and LitGPT's unit offset),
not from lnmonitor's detection.  Dropout is off, so that the float64 recomputation sees the
training step's forward.

A cell the condition does not apply to (no attention projections, no
``gradient_checkpointing_enable``) is skipped with its reason.  The grid found five faults of
lnmonitor when it was built (the probe's forward taking over step 0's padding mask, per-head
QK-norm rows without the mask, LayerNorm shares from a bf16 gradient, Mamba2's cast copy of
the stream read as a branch under bf16, a frozen embedding norm taken for a rung); each cell
they failed now passes.

``python tests/test_compatibility.py`` prints docs/compatibility.md's tables (the families at
float32, the grid, the worst gap per condition) from the same rows and columns; with ``--marks``
the compact table at the top of docs/compatibility.md (a mark per cell).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
import sys
import time
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
from torch.utils.data import DataLoader

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.invariance.results import CASES
from lnmonitor.core.maths.reductions import ROUNDING_ROW
from lnmonitor.core.meter.row_stats import SHARE_RESOLUTION, SIGMA_RESOLUTION

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, ROWS = 97, 16, 4, 8
PAD = 0
# real tokens per row under padding: 64 of 128 tokens are padding, 2..14 per row
LENGTHS = (2, 14, 4, 12, 6, 10, 8, 8)
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD,
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
    """nanoGPT's GPT; ``loops`` > 1 calls each block that many times (a looped block, as in
    ALBERT's sharing or Universal Transformers)."""

    def __init__(self, vocab=VOCAB, d=32, layers=2, heads=4, block=64, loops=1):
        super().__init__()
        self.loops = loops
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
            h=nn.ModuleList(NanoBlock(d, heads) for _ in range(layers)), ln_f=LayerNorm(d, bias=False),
        ))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            for _ in range(self.loops):
                x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ---------------------------------------------------------------------------
# the rows: families
# ---------------------------------------------------------------------------


@dataclass
class Family:
    """One row: how to build the model, which modules are its norms (class names), what they
    compute (kind and gain, from the family's code), the role each should get, and the names of
    its attention projections (what trains when only attention trains, and LoRA's targets)."""

    key: str
    label: str
    build: object
    norm_classes: tuple[str, ...]
    kind: str
    unit_offset: bool = False  # gain = 1 + weight
    roles: dict[str, str] = field(default_factory=dict)  # glob -> role; the rest: "residual"
    hf: bool = True  # a transformers model: forward(**batch) returns .loss; else forward(idx) -> logits
    final: str = ""
    refused: str = ""  # a norm class left out, named in one message with the reason
    attention: tuple[str, ...] = ()  # module names (last component) of the attention projections
    says: str = ""  # what the meter says once about this family (besides the conditions)
    ladder: bool = True  # check that a ladder of two rungs or more logs its attenuation
    decoder: bool = False  # an encoder-decoder: a padded batch marks the decoder's padding too


def _hf(config_cls, **kw):
    def build():
        cfg = getattr(transformers, config_cls)(**kw)
        return transformers.AutoModelForCausalLM.from_config(cfg)
    return build


def _auto(auto_cls, config_cls, **kw):
    def build():
        return getattr(transformers, auto_cls).from_config(getattr(transformers, config_cls)(**kw))
    return build


def _litgpt(norm, name="tiny"):
    def build():
        from litgpt import GPT, Config

        return GPT(Config(name=name, n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=VOCAB,
                          padded_vocab_size=VOCAB, norm_class_name=norm, bias=False))
    return build


QKV = ("q_proj", "k_proj", "v_proj")
GEMMA3_ROLES = {"*.post_attention_layernorm": "post", "*.post_feedforward_layernorm": "post",
                "*.q_norm": "qk", "*.k_norm": "qk"}
FAMILIES = [
    Family("gpt2", "GPT-2", _hf("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
           ("LayerNorm",), "layer", final="model.transformer.ln_f", attention=("c_attn",)),
    Family("neox", "GPT-NeoX (parallel residual)", _hf(
        "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64), ("LayerNorm",), "layer",
        final="model.gpt_neox.final_layer_norm", attention=("query_key_value",)),
    Family("llama", "Llama", _hf("LlamaConfig", **TINY), ("LlamaRMSNorm",), "rms", final="model.model.norm",
           attention=QKV),
    Family("mistral", "Mistral", _hf("MistralConfig", **TINY), ("MistralRMSNorm",), "rms",
           final="model.model.norm", attention=QKV),
    Family("phi3", "Phi-3", _hf("Phi3Config", **TINY), ("Phi3RMSNorm",), "rms", final="model.model.norm",
           attention=("qkv_proj",)),
    Family("qwen3", "Qwen3 (QK-norms)", _hf("Qwen3Config", **TINY, head_dim=8), ("Qwen3RMSNorm",), "rms",
           roles={"*.q_norm": "qk", "*.k_norm": "qk"}, final="model.model.norm", attention=QKV),
    Family("gemma", "Gemma (1 + weight)", _hf("GemmaConfig", **TINY, head_dim=8), ("GemmaRMSNorm",), "rms",
           unit_offset=True, final="model.model.norm", attention=QKV),
    Family("gemma2", "Gemma 2 (post-sublayer norms)", _hf("Gemma2Config", **TINY, head_dim=8),
           ("Gemma2RMSNorm",), "rms", unit_offset=True, roles=GEMMA3_ROLES, final="model.model.norm",
           attention=QKV),
    Family("gemma3", "Gemma 3 (QK- and post-norms)", _hf("Gemma3TextConfig", **TINY, head_dim=8),
           ("Gemma3RMSNorm",), "rms", unit_offset=True, roles=GEMMA3_ROLES, final="model.model.norm",
           attention=QKV),
    Family("olmo2", "OLMo 2 (no pre-norm)", _hf("Olmo2Config", **TINY), ("Olmo2RMSNorm",), "rms",
           roles={"*.post_attention_layernorm": "post", "*.post_feedforward_layernorm": "post",
                  "*.q_norm": "qk", "*.k_norm": "qk"}, final="model.model.norm", attention=QKV),
    Family("falcon", "Falcon (parallel)", _hf(
        "FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
        ("LayerNorm",), "layer", final="model.transformer.ln_f", attention=("query_key_value",)),
    Family("opt", "OPT", _hf("OPTConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
                             max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                             pad_token_id=PAD),
           ("LayerNorm",), "layer", final="model.model.decoder.final_layer_norm", attention=QKV),
    Family("litgpt-ln", "LitGPT GPT, LayerNorm", _litgpt("LayerNorm"), ("LayerNorm",), "layer", hf=False,
           final="model.transformer.ln_f", attention=("qkv",)),
    Family("litgpt-rms", "LitGPT GPT, RMSNorm", _litgpt("RMSNorm"), ("RMSNorm",), "rms", hf=False,
           final="model.transformer.ln_f", attention=("qkv",)),
    Family("litgpt-offset", "LitGPT GPT, RMSNorm add_unit_offset", _litgpt("RMSNorm", "Gemma-tiny"),
           ("RMSNorm",), "rms", unit_offset=True, hf=False, final="model.transformer.ln_f",
           attention=("qkv",)),
    Family("nanogpt", "nanoGPT-style (hand-written LayerNorm)", NanoGPT, ("LayerNorm",), "layer", hf=False,
           final="model.transformer.ln_f", attention=("attn",)),
    # post-LN: each block's norms normalise the sum after the residual add; no gradient goes
    # around any of them, so there is no pre-norm ladder; the MLM head's norm is the last to run
    # before the logits (the final norm of the invariance probe), a ladder of one rung
    Family("bert", "BERT (post-LN, masked LM)", _auto(
        "AutoModelForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD), ("LayerNorm",), "layer",
        roles={"*.embeddings.LayerNorm": "embedding", "*.encoder.layer.*": "post"},
        final="model.cls.predictions.transform.LayerNorm", attention=("query", "key", "value")),
    Family("bloom", "BLOOM (embedding norm)", _hf(
        "BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
        attention_dropout=0.0, pad_token_id=PAD), ("LayerNorm",), "layer",
        roles={"*.word_embeddings_layernorm": "embedding"}, final="model.transformer.ln_f",
        attention=("query_key_value",)),
    # the gated norm inside each mixer computes rmsnorm(x * silu(gate)) from forward(x, gate):
    # measured on x it logged sigma 0.155 against 0.044 true; it is left out and named
    Family("mamba2", "Mamba2 (gated norms left out)", _hf(
        "Mamba2Config", vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, num_heads=4,
        head_dim=16, expand=2, n_groups=1, chunk_size=8, pad_token_id=PAD, bos_token_id=1, eos_token_id=2),
        ("Mamba2RMSNorm",), "rms", final="model.backbone.norm_f", refused="MambaRMSNormGated"),
    # one block called three times: its norms pool three depths, so they are kept out of the
    # ladder (said once) and the final norm is its only rung
    Family("looped", "looped block (one nanoGPT block called 3 times)", lambda: NanoGPT(layers=1, loops=3),
           ("LayerNorm",), "layer", hf=False, final="model.transformer.ln_f", attention=("attn",),
           says="more often than the other norms"),
    # ----- encoder-decoder stacks ---------------------------------------------------------------
    # How an encoder-decoder's norms get their roles and ladders is being changed (another
    # piece of work): these rows assert what holds regardless -- every norm found, sigma and
    # shares against float64 on the real tokens -- and the roles their ``roles`` say, which
    # that work updates (today: each stack's last norm is a 'final' norm); their ladders are
    # that work's too (ladder=False).  A padded batch gives the decoder's padding as
    # decoder_attention_mask (the encoder's is attention_mask); the source and the target have
    # the same length, so that a mask applied to the wrong stack would fit its rows.
    Family("t5", "T5 (encoder-decoder, RMS)", _auto(
        "AutoModelForSeq2SeqLM", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
        num_heads=4, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD),
        ("T5LayerNorm",), "rms", roles={"*.encoder.final_layer_norm": "final"},
        final="model.decoder.final_layer_norm", attention=("q", "k", "v"), ladder=False, decoder=True),
    Family("bart", "BART (encoder-decoder, post-LN)", _auto(
        "AutoModelForSeq2SeqLM", "BartConfig", vocab_size=VOCAB, d_model=32, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2),
        ("LayerNorm",), "layer", roles={"*.layernorm_embedding": "embedding",
                                         "*.encoder.layers.1.final_layer_norm": "final",
                                         "*.layers.*": "post"},
        final="model.model.decoder.layers.1.final_layer_norm", attention=QKV, ladder=False, decoder=True),
    # ----- end of the encoder-decoder stacks ----------------------------------------------------
]


# ---------------------------------------------------------------------------
# the columns: conditions
# ---------------------------------------------------------------------------


LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class Condition:
    """One column: what differs from a float32 fit of every parameter on full batches."""

    key: str
    label: str
    precision: str = "32-true"
    pad: str | None = None  # "right" or "left": half the tokens padding, marked by attention_mask
    train: str = "all"  # "attention": only the attention projections; "lora": peft LoRA on them
    checkpointing: bool = False  # model.gradient_checkpointing_enable()
    default: bool = False  # in the default run; the rest are slow

    @property
    def low(self) -> torch.dtype | None:
        """The low-precision dtype the forward computes in, if any."""
        return LOW_PRECISION.get(self.precision)


CONDITIONS = [
    Condition("32-true", "32-true", default=True),
    Condition("bf16-mixed", "bf16-mixed", precision="bf16-mixed"),
    Condition("bf16-true", "bf16-true", precision="bf16-true", default=True),
    Condition("16-mixed", "16-mixed", precision="16-mixed"),
    Condition("pad-right", "right padding", pad="right", default=True),
    Condition("pad-left", "left padding", pad="left"),
    Condition("attention-only", "attention only", train="attention"),
    Condition("lora", "LoRA (peft)", train="lora"),
    Condition("checkpointing", "gradient checkpointing", checkpointing=True),
]


@dataclass(frozen=True)
class Bounds:
    median: float  # |logged share median - float64 median|
    max: float  # |logged share max - float64 max|
    sigma: float  # |logged sigma / float64 sigma - 1|


# float32: the histograms resolve a share to 2.4e-4 and sigma to 0.39%; the float32 rounding of
# the rows is far below both, so these bounds hold with a wide margin (worst measured: 1e-4
# on a median share, 1e-6 on a max share, 0.13% on sigma)
FLOAT32 = Bounds(median=0.01, max=1e-4, sigma=0.01)
# low precision: the float64 reference runs the same (bf16-rounded, under bf16-true) weights,
# but every matmul of the monitored forward and backward rounds to the low dtype, so a row's x
# and gradient differ from float64 by a few units of its roundoff u (bf16 2^-7, fp16 2^-10),
# growing through the layers.  A median share and a median sigma are averages over rows, so
# their gaps stay a few u; the max share is one row's extreme, so its gap is that row's own
# rounding (BLOOM under bf16-true: 3.7u).  Bounds in units of u, a little above the worst cell
# measured on the grid.  What is the monitor's own is checked apart, against float64 statistics
# of the very tensors the step ran (``Cell.own``): within the float32 bounds.
LOW_PRECISION_U = Bounds(median=3.5, max=4.0, sigma=0.5)


def bounds(cond: Condition) -> Bounds:
    if cond.low is None:
        return FLOAT32
    u = torch.finfo(cond.low).eps
    return Bounds(LOW_PRECISION_U.median * u, LOW_PRECISION_U.max * u, LOW_PRECISION_U.sigma * u)


# Lightning 2.6 on a CPU: "AMP with fp16 is not supported on CPU. Using precision='bf16-mixed'
# instead" -- a 16-mixed cell would silently be a bf16-mixed one (CUDA fp16 with its GradScaler:
# tests/test_cuda.py)
FP16_ON_CPU = "Lightning runs bf16-mixed instead: AMP with fp16 is not supported on CPU"


def not_applicable(family: Family, cond: Condition) -> str | None:
    """Why a condition does not apply to a family (one line), or None."""
    if cond.precision == "16-mixed":
        return FP16_ON_CPU
    if cond.train != "all" and not family.attention:
        return "no attention projections to train (a state-space mixer)"
    if cond.checkpointing and not family.hf:
        return "no gradient_checkpointing_enable (not a transformers model)"
    return None




# ---------------------------------------------------------------------------
# one cell
# ---------------------------------------------------------------------------


class Wrapped(L.LightningModule):
    """The usual way: no forward; training_step returns the model's loss."""

    def __init__(self, model, hf: bool):
        super().__init__()
        self.model, self.hf = model, hf

    def training_step(self, batch, batch_idx):
        if self.hf:
            return self.model(**batch).loss
        # a model that takes no attention_mask reads the pads: causal attention keeps right
        # padding from the real tokens, left padding does not (the monitor masks either way)
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.AdamW((p for p in self.parameters() if p.requires_grad), lr=1e-3)


class Capture(Callback):
    """The weights and the batch of step 0, before its update."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and not hasattr(self, "state"):
            self.state = copy.deepcopy(pl_module.state_dict())
            self.batch = {k: v.clone() for k, v in batch.items()}


def data(seed: int, pad: str | None, decoder: bool = False) -> DataLoader:
    """Two batches of 4 rows; with ``pad``, each row keeps LENGTHS real tokens (right- or
    left-aligned), the rest pad id 0, attention_mask 0, label -100 (and, for an encoder-decoder,
    decoder_attention_mask 0: the targets are padded alike)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if pad is not None:
        keep = torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]
        keep = keep.flip(1) if pad == "left" else keep
        ids = torch.where(keep, ids, PAD)
        batch = {"input_ids": ids, "attention_mask": keep.long(), "labels": torch.where(keep, ids, -100)}
        if decoder:
            batch["decoder_attention_mask"] = keep.long()
    return DataLoader([{k: v[i] for k, v in batch.items()} for i in range(ROWS)], batch_size=BATCH)


def build(family: Family, cond: Condition) -> nn.Module:
    """The family's model as the condition trains it."""
    torch.manual_seed(0)
    model = family.build()
    if cond.checkpointing:
        model.gradient_checkpointing_enable()
    if cond.train == "lora":
        import peft

        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(family.attention))
        model = peft.get_peft_model(model, config)
    elif cond.train == "attention":  # plain freezing: everything but the attention projections
        for name, p in model.named_parameters():
            p.requires_grad_(any(part in family.attention for part in name.split(".")[:-1]))
    return model


def canonical(name: str) -> str:
    """A norm's name without peft's wrapping (``model.base_model.model.`` -> ``model.``)."""
    return "model." + name.removeprefix("model.base_model.model.") if name.startswith("model.base_model.") \
        else name


def expected_role(family: Family, name: str) -> str:
    name = canonical(name)
    if name == family.final:
        return "final"
    return next((role for pattern, role in family.roles.items() if fnmatch.fnmatchcase(name, pattern)),
                "residual")


def kept_rows(x: torch.Tensor, keep: torch.Tensor | None) -> np.ndarray | None:
    """Which of ``x``'s rows (all but the last dimension) are real tokens: a row belongs to
    the token whose (batch, position) it is, for (B, T, ..., d) and per-head (B, H, T, d)."""
    if keep is None:
        return None
    b, t = keep.shape
    if x.ndim == 2 and x.shape[0] == b * t:  # OPT flattens the tokens before its MLP's norm
        return keep.reshape(-1).numpy()
    if tuple(x.shape[:2]) == (b, t):
        return keep.reshape(b, t, *[1] * (x.ndim - 3)).expand(x.shape[:-1]).reshape(-1).numpy()
    if x.ndim == 4 and x.shape[0] == b and x.shape[2] == t:
        return keep[:, None, :].expand(x.shape[:-1]).reshape(-1).numpy()
    raise AssertionError(f"no token layout for a norm input of shape {tuple(x.shape)}")


def reference(family: Family, module: Wrapped, state, batch: dict, checkpointing: bool,
              precision=None) -> dict[str, dict]:
    """Independent float64 statistics of step 0 on the real tokens: the family's norm modules
    by class name, their gain by the family's definition, shares by QR; every call of a norm
    pooled (a looped block's norm runs three times); a norm whose output needs no gradient has
    no share.  The model runs in float64 on the step's weights; with ``precision`` (the
    Trainer's precision plugin) it runs as the training step did, in its own dtypes, and only
    the statistics are float64 (the same tensors the monitor saw)."""
    ref = copy.deepcopy(module)
    ref.load_state_dict(state)
    ref = ref.double() if precision is None else precision.convert_module(ref)
    if checkpointing:  # the same maths without recomputation
        ref.model.gradient_checkpointing_disable()
    keys = {"encoder": "attention_mask", "decoder": "decoder_attention_mask"}
    masks = {stack: batch[key].bool() for stack, key in keys.items() if key in batch}
    calls: dict[str, list[dict]] = {}
    norms = {n: m for n, m in ref.named_modules() if type(m).__name__ in family.norm_classes}
    for name, m in norms.items():
        calls[name] = []

        def hook(mod, a, o, name=name):
            call = {"x": a[0].detach().double(), "g": None}
            calls[name].append(call)
            if o.requires_grad:
                o.register_hook(lambda g: call.__setitem__("g", g.detach().double()))
        m.register_forward_hook(hook)
    context = contextlib.nullcontext() if precision is None else precision.forward_context()
    with torch.enable_grad(), context:
        loss = ref.training_step({k: v.clone() for k, v in batch.items()}, 0)
    loss.backward()
    out = {}
    for name, m in norms.items():
        weight = getattr(m, "weight", None)
        offset = 1.0 if family.unit_offset else 0.0
        gain = None if weight is None else weight.detach().double().numpy() + offset
        xs, shares = [], []
        for call in calls[name]:
            d = call["x"].shape[-1]
            keep = masks.get("decoder" if family.decoder and ".decoder." in name else "encoder")
            rows = kept_rows(call["x"], keep)
            x = call["x"].reshape(-1, d).numpy()
            x = x if rows is None else x[rows]
            xs.append(x)
            if call["g"] is None:
                continue
            g = call["g"].reshape(-1, d).numpy()
            g = g if rows is None else g[rows]
            w = g if gain is None else g * gain
            # rows with (next to) no gradient carry no share: a shifted loss leaves the last real
            # position empty, causal attention the query at position 0 (the contract's rule, per call)
            size = np.linalg.norm(w, axis=1)
            informative = size > ROUNDING_ROW * np.sqrt(np.mean(size**2))
            shares.append(qr_share(x[informative], w[informative], family.kind))
        x = np.concatenate(xs)
        var = x.var(1) if family.kind == "layer" else (x**2).mean(1)
        eps = next((float(getattr(m, a)) for a in ("eps", "variance_epsilon")
                    if getattr(m, a, None) is not None), 1e-5)  # nanoGPT's: 1e-5 in its forward
        share = np.concatenate(shares) if shares else None
        out[name] = dict(share=share if share is not None and share.size else None, calls=len(calls[name]),
                         gradient=all(c["g"] is not None for c in calls[name]),
                         finite=all(c["g"] is None or bool(c["g"].isfinite().all()) for c in calls[name]),
                         sigma=math.sqrt(np.median(var) + eps))
    return out


@dataclass
class Cell:
    family: Family
    cond: Condition
    module: Wrapped
    ln: LayerNormMonitor
    inv: FinalNormInvarianceMonitor
    trainer: L.Trainer
    said: list[str]
    ref: dict[str, dict]  # float64 forward and backward
    own: dict[str, dict] | None  # low precision: float64 statistics of the step's own tensors
    seconds: float

    @property
    def no_gradient(self) -> list[str]:
        return [n for n, r in self.ref.items() if not r["gradient"]]

    def gaps(self, own: bool = False) -> Bounds:
        """The worst gap of each statistic to float64 over the norms (0 when none has it)."""
        h, ref = self.ln.history[0], self.own if own else self.ref
        shared = {n: r["share"] for n, r in ref.items() if r["share"] is not None}
        return Bounds(
            median=max((abs(h[f"lnmonitor/share_median/{n}"] - np.median(s)) for n, s in shared.items()),
                       default=0.0),
            max=max((abs(h[f"lnmonitor/share_max/{n}"] - s.max()) for n, s in shared.items()), default=0.0),
            sigma=max(abs(h[f"lnmonitor/sigma/{n}"] / r["sigma"] - 1) for n, r in ref.items()),
        )


def run(family: Family, cond: Condition) -> Cell:
    """Fit two steps with both monitors at their defaults (in the README's order); the float64
    references of step 0."""
    start = time.perf_counter()
    module = Wrapped(build(family, cond), family.hf)
    ln, inv = LayerNormMonitor(keep_history=True), FinalNormInvarianceMonitor(keep_history=True)
    capture = Capture()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        log_every_n_steps=1, limit_val_batches=1,
                        callbacks=[ln, inv, capture],
                        precision=cond.precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data(0, cond.pad, family.decoder), data(1, cond.pad, family.decoder))
    args = (family, module, capture.state, capture.batch, cond.checkpointing)
    own = None if cond.low is None else reference(*args, precision=trainer.precision_plugin)
    said, ref = [str(w.message) for w in caught], reference(*args)
    if not all(r["finite"] for r in ref.values()):
        # the model's own float64 forward is not finite (T5 and BLOOM, left padding: every
        # gradient nan) while its float32 step is: the statistics of the step's own tensors in
        # float64 are the reference then
        ref = reference(*args, precision=trainer.precision_plugin)
    return Cell(family, cond, module, ln, inv, trainer, said, ref, own, time.perf_counter() - start)


def check(cell: Cell) -> None:
    """What every cell must show: the fit, the norms and their float32 roles, step 0 against
    float64 within the condition's bounds, what the meter says, the invariance probe on."""
    family, cond, ln, inv, said = cell.family, cell.cond, cell.ln, cell.inv, cell.said
    assert cell.trainer.global_step == 2
    assert [h["step"] for h in ln.history] == [0, 1]
    assert sorted(n.name for n in ln.norms) == sorted(cell.ref)  # every norm found, none refused
    assert all(n.kind == family.kind for n in ln.norms)
    roles = {n.name: n.role for n in ln.norms}
    assert roles == {n: expected_role(family, n) for n in cell.ref}, \
        {n: r for n, r in roles.items() if r != expected_role(family, n)}
    h, b, gaps = ln.history[0], bounds(cond), cell.gaps()
    for name, r in cell.ref.items():
        assert (f"lnmonitor/share_median/{name}" in h) == (r["share"] is not None), name
    assert gaps.median <= b.median and gaps.max <= b.max and gaps.sigma <= b.sigma, (gaps, b)
    if cell.own is not None:  # the monitor read its own low-precision tensors as float64 does
        own = cell.gaps(own=True)
        assert own.median <= FLOAT32.median and own.max <= FLOAT32.max and own.sigma <= FLOAT32.sigma, own
    # a norm that no gradient reaches is measured from its forward, and the meter says why
    # it has no share (naming the first of them)
    without = sorted(cell.no_gradient, key=list(cell.ref).index)
    assert sum("no gradient reaches" in w for w in said) == (1 if without else 0)
    assert not without or any(f"no gradient reaches {without[0]}" in w for w in said)
    assert sum("attention_mask marks padding" in w for w in said) == (1 if cond.pad else 0)
    # the ladder: the rungs called once per step (a looped block's norms are kept out)
    fewest = min(r["calls"] for r in cell.ref.values())
    rungs = [n.name for n in ln.norms
             if n.role in ("residual", "final") and cell.ref[n.name]["calls"] == fewest]
    assert not family.ladder or ("lnmonitor/ladder/attenuation" in h) == (len(rungs) >= 2)
    if family.says:
        assert sum(family.says in w for w in said) == 1
    assert not any("Traceback" in w for w in said)
    refused = [w for w in said if "look like normalisation layers but are not measured" in w]
    assert len(refused) == (2 if family.refused else 0)  # once per monitor
    assert all(f"{family.refused} (" in w and "more than the input it normalises (gate)" in w
               for w in refused)
    # the invariance monitor: on, on the family's final norm, with its five cases
    assert inv.off_reason is None, inv.off_reason
    assert canonical(inv.last_result.final_norm) == family.final
    h = inv.history[0]
    for case in CASES:
        assert f"lnmonitor/invariance/{case}/dloss" in h and f"lnmonitor/invariance/{case}/out_residual" in h
    if cond.low is None:
        assert abs(h["lnmonitor/invariance/axis_5/dloss"]) > 0
        if family.kind == "layer":
            assert h["lnmonitor/invariance/shift_5/dloss"] == 0.0
        assert abs(h["lnmonitor/invariance/scale_3/dloss"]) < 1e-3


def cells(default_only: bool = False):
    for family in FAMILIES:
        for cond in CONDITIONS:
            why, marks = not_applicable(family, cond), []
            if why:
                marks.append(pytest.mark.skip(reason=why))
            if not cond.default:
                marks.append(pytest.mark.slow)
            yield pytest.param(family, cond, id=f"{family.key}-{cond.key}", marks=marks)


def test_16_mixed_on_a_cpu_is_refused_by_lightning():
    """The grid's 16-mixed column: Lightning swaps it for bf16-mixed on a CPU, and says so."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert trainer.precision == "bf16-mixed"
    assert any("AMP with fp16 is not supported on CPU" in str(w.message) for w in caught)


@pytest.mark.parametrize("family, cond", cells())
def test_cell_against_float64_on_the_real_tokens(family, cond):
    if cond.train == "lora":
        pytest.importorskip("peft")
    check(run(family, cond))


# ---------------------------------------------------------------------------
# the tables of docs/compatibility.md and the README
# ---------------------------------------------------------------------------


def family_row(cell: Cell) -> str:
    family, ln, inv = cell.family, cell.ln, cell.inv
    roles: dict[str, int] = {}
    for n in ln.norms:
        roles[n.role] = roles.get(n.role, 0) + 1
    gain = "1 + weight" if family.unit_offset else "weight"
    role_text = ", ".join(f"{roles[k]} {k}" for k in ("residual", "final", "qk", "embedding", "post")
                          if k in roles)
    on = "on, 5 cases" if inv.off_reason is None else "off"
    return (f"| {family.label} | {len(ln.norms)} {family.kind}, gain {gain} | {role_text} | "
            f"`{inv.last_result.final_norm.removeprefix('model.')}` | {on} |")


def grid_cell(cell: Cell) -> str:
    g = cell.gaps()
    text = f"{g.median:.0e} / {g.max:.0e} / {g.sigma:.0e}"
    if cell.no_gradient:
        text += f" ({len(cell.no_gradient)} without gradient)"
    return text


def marks(grid: dict[str, list[str]], conditions, families) -> None:
    """docs/compatibility.md's compact table: a mark per cell (pass, not applicable, fails, error)."""
    def mark(text: str) -> str:
        return "-" if text.startswith("n/a") else "x" if text.startswith(("FAILS", "error")) else "ok"

    print("| model | " + " | ".join(c.label for c in conditions) + " |")
    print("|---|" + "---|" * len(conditions))
    for family in families:
        print(f"| {family.label} | " + " | ".join(mark(t) for t in grid[family.key]) + " |")


def main(argv: list[str]) -> None:
    print(f"share resolution {SHARE_RESOLUTION:.1e}, sigma resolution {SIGMA_RESOLUTION:.1e}")
    keys = [a for a in argv if not a.startswith("-")]
    # arguments: condition and family keys (default: all); --marks: docs/compatibility.md's compact table
    conditions = [c for c in CONDITIONS if c.key in keys or not {x.key for x in CONDITIONS} & set(keys)]
    families = [f for f in FAMILIES if f.key in keys or not {x.key for x in FAMILIES} & set(keys)]
    grid: dict[str, list[str]] = {}
    rows, worst, seconds = [], {c.key: Bounds(0.0, 0.0, 0.0) for c in conditions}, {}
    for family in families:
        for cond in conditions:
            why = not_applicable(family, cond)
            if why:
                grid.setdefault(family.key, []).append(f"n/a: {why}")
                continue
            try:
                cell = run(family, cond)
            except Exception as err:  # noqa: BLE001 - the grid says what failed
                text = f"error: {type(err).__name__}: {str(err)[:80]}"
                grid.setdefault(family.key, []).append(text)
                print(f"  {family.key} {cond.key}: {text}", file=sys.stderr, flush=True)
                continue
            seconds[cond.key] = seconds.get(cond.key, 0.0) + cell.seconds
            try:
                check(cell)
                text = grid_cell(cell)
            except Exception as err:  # noqa: BLE001 - the grid says what failed
                text = f"FAILS: {grid_cell(cell)} {' '.join(str(err).split())[:200]}"
            grid.setdefault(family.key, []).append(text)
            g, w = cell.gaps(), worst[cond.key]
            worst[cond.key] = Bounds(max(w.median, g.median), max(w.max, g.max), max(w.sigma, g.sigma))
            if cond.key == "32-true":
                rows.append(family_row(cell))
            print(f"  {family.key} {cond.key}: {text} ({cell.seconds:.1f} s)", file=sys.stderr, flush=True)
    if "--marks" in argv:
        marks(grid, conditions, families)
        return
    print("| model | norms found | roles | final norm | invariance (defaults) |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| model | " + " | ".join(c.label for c in conditions) + " |")
    print("|---|" + "---|" * len(conditions))
    for family in families:
        print(f"| {family.label} | " + " | ".join(grid[family.key]) + " |")
    print()
    print("| condition | worst median share | worst max share | worst sigma | bound (median / max / sigma) | "
          "seconds |")
    print("|---|---|---|---|---|---|")
    for c in conditions:
        w, b = worst[c.key], bounds(c)
        print(f"| {c.label} | {w.median:.1e} | {w.max:.1e} | {w.sigma:.1e} | "
              f"{b.median:.1e} / {b.max:.1e} / {b.sigma:.1e} | {seconds.get(c.key, 0):.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
