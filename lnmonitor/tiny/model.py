"""A configurable pre-norm character GPT (plain PyTorch); the default configuration is the study's
reference model (docs/design.md): 816,128 parameters at a 65-symbol vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lnmonitor.core.kinds import NORM_KINDS
from lnmonitor.tiny.recipe import ATTENTIONS, INITS

__all__ = ["MLP", "Block", "CausalSelfAttention", "GPTConfig", "make_norm", "TinyGPT"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`TinyGPT`. ``norm`` is ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm)."""

    vocab_size: int = 65
    width: int = 128
    depth: int = 4
    heads: int = 4
    context: int = 64
    mlp_ratio: int = 4
    norm: Literal["layer", "rms"] = "layer"
    eps: float = 1e-5
    attention: Literal["sdpa", "explicit"] = "sdpa"
    init: Literal["default", "gpt2"] = "default"
    qk_norm: bool = False  # a norm of each head's queries and keys (Wortsman et al. 2023's fix)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "width", "depth", "heads", "context", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}: "
                             "choose a width that is a multiple of the number of heads")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"norm must be one of {NORM_KINDS}, got {self.norm!r}")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"qk_norm must be True or False, got {self.qk_norm!r}")


def make_norm(config: GPTConfig, width: int | None = None) -> nn.Module:
    """The configured norm over ``width`` features (default: the model's width)."""
    norm = nn.LayerNorm if config.norm == "layer" else nn.RMSNorm
    return norm(width or config.width, eps=config.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.explicit = config.attention == "explicit"
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.proj = nn.Linear(config.width, config.width, bias=False)
        mask = torch.ones(config.context, config.context, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)
        if config.qk_norm:  # per head, over the head dimension
            self.q_norm = make_norm(config, config.width // config.heads)
            self.k_norm = make_norm(config, config.width // config.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.explicit:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(~self.causal_mask[:time, :time], float("-inf"))
            out = scores.softmax(dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, time, width))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, config.mlp_ratio * config.width)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.mlp_ratio * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Character GPT: embeddings, pre-norm blocks, a final norm ``lnf`` and a bias-free head.
    ``config.init``: ``"default"`` keeps PyTorch's initialisation (embeddings N(0, 1)), ``"gpt2"`` is
    GPT-2's.  ``forward(idx, targets=None)`` returns ``(logits, loss)``, loss the mean cross-entropy in
    nats per character (None without targets)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.width)
        self.pos_emb = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.lnf = make_norm(config)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        if config.init == "gpt2":
            self._gpt2_init()

    @torch.no_grad()
    def _gpt2_init(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        for block in self.blocks:  # the projections that write into the residual stream
            for proj in (block.attn.proj, block.mlp.proj):
                proj.weight.normal_(0.0, 0.02 / math.sqrt(2 * self.config.depth))

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        time = idx.shape[1]
        if time > self.config.context:
            raise ValueError(f"sequence length {time} exceeds the context {self.config.context}")
        positions = torch.arange(time, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.lnf(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
