"""The train-tiny recipe's settings, validated (a one-line :class:`~lnmonitor.errors.UsageError`) before
anything is written; no torch is imported, so the command line can show and check them at once."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lnmonitor.core.kinds import NORM_KINDS
from lnmonitor.errors import UsageError

__all__ = ["ATTENTIONS", "DECAYS", "INITS", "LATER_OPTIONS", "Recipe", "SCHEDULES"]

ATTENTIONS = ("sdpa", "explicit")  # the tiny GPT's attention implementations
# PyTorch's own initialisation (embeddings N(0, 1), the study's), or GPT-2's: N(0, 0.02) weights and
# 0.02 / sqrt(2 depth) on the residual projections
INITS = ("default", "gpt2")
DECAYS = ("all", "matrices")  # weight decay on every parameter (the study's), or on the matrices only
SCHEDULES = ("one-cycle", "constant")  # one cycle (warm-up over the first 30%, the study's), or constant
# options added after the study's recipe: left out of the hyperparameters and the record while at their
# defaults, so runs and checkpoints made before them still match
LATER_OPTIONS = {"qk_norm": False, "z_loss": 0.0, "schedule": "one-cycle"}


@dataclass(frozen=True)
class Recipe:
    """Hyperparameters of one train-tiny run; the defaults are the study's (docs/design.md)."""

    eps: float = 1e-5
    norm: str = "layer"
    width: int = 128
    depth: int = 4
    heads: int = 4
    context: int = 64
    attention: str = "sdpa"
    max_steps: int = 3000
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    decay: str = "all"
    init: str = "default"
    grad_clip: float = 1.0
    seed: int = 0
    val_every: int = 250
    qk_norm: bool = False
    z_loss: float = 0.0
    schedule: str = "one-cycle"
    trainer_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("width", "depth", "heads", "context", "max_steps", "batch_size", "val_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("eps", "lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UsageError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("weight_decay", "grad_clip", "z_loss"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise UsageError(f"{name.replace('_', '-')} must be a finite number >= 0, got {value!r}")
        if self.norm not in NORM_KINDS:
            raise UsageError(f"norm must be one of {', '.join(NORM_KINDS)}, got {self.norm!r}")
        if not isinstance(self.qk_norm, bool):
            raise UsageError(f"qk-norm must be true or false, got {self.qk_norm!r}")
        for name, allowed in (("attention", ATTENTIONS), ("init", INITS), ("decay", DECAYS),
                              ("schedule", SCHEDULES)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.width % self.heads:
            raise UsageError(f"width {self.width} is not divisible by heads {self.heads}: "
                             "choose a width that is a multiple of the number of heads")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"seed must be an integer >= 0, got {self.seed!r}")

    def module_kwargs(self, vocab: str) -> dict:
        """Keyword arguments of :class:`TinyGPTModule` for ``vocab`` (the vocabulary's characters)."""
        return dict(vocab=vocab, width=self.width, depth=self.depth, heads=self.heads, context=self.context,
                    norm=self.norm, eps=float(self.eps), attention=self.attention, lr=float(self.lr),
                    weight_decay=float(self.weight_decay), decay=self.decay, init=self.init,
                    max_steps=self.max_steps, **self._later_options())

    def _later_options(self) -> dict:
        return {k: getattr(self, k) for k, default in LATER_OPTIONS.items() if getattr(self, k) != default}

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "trainer_kwargs" and k not in LATER_OPTIONS}
        return {**out, **self._later_options()}
