"""The train-tiny recipe: fit a :class:`TinyGPTModule` on a character corpus.

``Recipe`` holds every knob and validates it before anything is written, so bad
input fails with a one-line :class:`UsageError` and leaves the output folder
untouched. :func:`fit` is shared by ``train-tiny`` and ``eps-compare``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor.errors import UsageError
from lnmonitor.tiny.data import CharDataModule, CharVocab
from lnmonitor.tiny.model import ATTENTIONS, NORMS, GPTConfig
from lnmonitor.tiny.module import TinyGPTModule


@dataclass(frozen=True)
class Recipe:
    """Hyperparameters of one train-tiny run; the defaults are DESIGN.md section 2's."""

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
    grad_clip: float = 1.0
    seed: int = 0
    val_every: int = 250
    trainer_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive_ints = ("width", "depth", "heads", "context", "max_steps", "batch_size", "val_every")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("eps", "lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UsageError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise UsageError(f"{name.replace('_', '-')} must be a finite number >= 0, got {value!r}")
        if self.norm not in NORMS:
            raise UsageError(f"norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if self.attention not in ATTENTIONS:
            raise UsageError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.width % self.heads:
            raise UsageError(
                f"width {self.width} is not divisible by heads {self.heads}: "
                "choose a width that is a multiple of the number of heads"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"seed must be an integer >= 0, got {self.seed!r}")

    def module_kwargs(self, vocab: CharVocab) -> dict:
        return dict(
            vocab=vocab.chars, width=self.width, depth=self.depth, heads=self.heads,
            context=self.context, norm=self.norm, eps=float(self.eps), attention=self.attention,
            lr=float(self.lr), weight_decay=float(self.weight_decay), max_steps=self.max_steps,
        )

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=vocab_size, width=self.width, depth=self.depth, heads=self.heads,
            context=self.context, norm=self.norm, eps=float(self.eps), attention=self.attention,
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("trainer_kwargs")
        return out


@dataclass(frozen=True)
class FitResult:
    val_loss: float
    log_dir: Path
    checkpoint: Path
    steps: int


def monitor_callbacks() -> list[Callback]:
    """The monitoring callbacks train-tiny attaches by default: :class:`LayerNormMonitor`
    (every ``log_every_n_steps``) and :class:`FinalNormInvarianceMonitor` (every 1000
    steps and after each validation), both at their defaults."""
    from lnmonitor.callbacks import FinalNormInvarianceMonitor, LayerNormMonitor

    return [LayerNormMonitor(), FinalNormInvarianceMonitor()]


def fit(
    recipe: Recipe, text: str, log_dir: Path, *, logger: TensorBoardLogger | None = None,
    callbacks: list[Callback] | None = None, resume: bool = True, progress: bool = True,
) -> FitResult:
    """Train the recipe on ``text`` with checkpoints in ``log_dir/checkpoints``.

    With ``resume``, a ``last.ckpt`` already there is continued from, so an
    interrupted fit loses at most ``val_every`` steps. Returns the final
    validation loss (nats per character) on the fixed held-out windows.
    """
    L.seed_everything(recipe.seed, workers=True, verbose=False)
    data = CharDataModule(
        text, context=recipe.context, batch_size=recipe.batch_size, seed=recipe.seed,
        max_steps=recipe.max_steps,
    )
    module = TinyGPTModule(**recipe.module_kwargs(data.vocab))
    ckpt_dir = Path(log_dir) / "checkpoints"
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, every_n_train_steps=recipe.val_every, save_top_k=0,
        save_last=True, enable_version_counter=False,
    )
    trainer_kwargs = dict(
        max_steps=recipe.max_steps, gradient_clip_val=recipe.grad_clip or None,
        val_check_interval=recipe.val_every, check_val_every_n_epoch=None,
        logger=logger if logger is not None else False,
        callbacks=[checkpoint, *(callbacks or [])], enable_progress_bar=progress,
        enable_model_summary=False, log_every_n_steps=min(50, recipe.val_every),
        num_sanity_val_steps=0, deterministic=False,
    )
    trainer_kwargs.update(recipe.trainer_kwargs)
    trainer = L.Trainer(**trainer_kwargs)
    last = ckpt_dir / "last.ckpt"
    ckpt_path = last if resume and last.is_file() else None
    with warnings.catch_warnings():
        # RandomWindows knows its exact length; the warning is about worker sharding.
        warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    trainer.save_checkpoint(last, weights_only=False)  # full state: resumable
    val_loss = trainer.callback_metrics.get("val/loss")
    if val_loss is None or trainer.global_step % recipe.val_every:
        val_loss = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    return FitResult(
        val_loss=float(val_loss), log_dir=Path(log_dir), checkpoint=last, steps=trainer.global_step
    )


def load_module(checkpoint: str | Path, map_location: str | torch.device = "cpu") -> TinyGPTModule:
    """Load a train-tiny checkpoint back into a :class:`TinyGPTModule` (eval mode)."""
    module = TinyGPTModule.load_from_checkpoint(
        checkpoint, map_location=map_location, weights_only=True
    )
    return module.eval()
