"""The train-tiny recipe's fit of a :class:`TinyGPTModule` on a character corpus (``train-tiny`` and
``eps-compare``)."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from lnmonitor.core.output.metric_names import VAL_LOSS
from lnmonitor.tiny.data import CharDataModule
from lnmonitor.tiny.module import TinyGPTModule
from lnmonitor.tiny.progress import ProgressLines
from lnmonitor.tiny.recipe import Recipe

__all__ = ["fit", "FitResult", "monitor_callbacks"]


@dataclass(frozen=True)
class FitResult:
    val_loss: float
    log_dir: Path
    checkpoint: Path
    steps: int


def monitor_callbacks() -> list[Callback]:
    """The monitoring callbacks train-tiny attaches by default: :class:`LayerNormMonitor` and
    :class:`FinalNormInvarianceMonitor`, both at their defaults."""
    from lnmonitor.lightning import FinalNormInvarianceMonitor, LayerNormMonitor

    return [LayerNormMonitor(), FinalNormInvarianceMonitor()]


def fit(recipe: Recipe, text: str, log_dir: Path, *, logger: TensorBoardLogger | None = None,
        callbacks: list[Callback] | None = None, resume: bool = True, progress: bool = True) -> FitResult:
    """Train the recipe on ``text`` with checkpoints in ``log_dir/checkpoints``; with ``resume``, from a
    ``last.ckpt`` already there.  The result's ``val_loss`` is the final validation loss (nats per
    character).  With ``progress``, a tqdm bar on a terminal (Lightning's rich bar reads "Epoch 0/-2" in
    a fit bounded by steps), :class:`ProgressLines` on anything else."""
    L.seed_everything(recipe.seed, workers=True, verbose=False)
    data = CharDataModule(text, context=recipe.context, batch_size=recipe.batch_size, seed=recipe.seed,
                          max_steps=recipe.max_steps)
    module = TinyGPTModule(**recipe.module_kwargs(data.vocab.chars))
    ckpt_dir = Path(log_dir) / "checkpoints"
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=recipe.val_every, save_top_k=0,
                                 save_last=True, enable_version_counter=False)
    bar = progress and sys.stdout.isatty()
    shown = [TQDMProgressBar()] if bar else [ProgressLines()] if progress else []
    trainer = L.Trainer(**dict(
        max_steps=recipe.max_steps, gradient_clip_val=recipe.grad_clip or None,
        val_check_interval=recipe.val_every, check_val_every_n_epoch=None,
        logger=logger if logger is not None else False, callbacks=[checkpoint, *shown, *(callbacks or [])],
        enable_progress_bar=bar, enable_model_summary=False, log_every_n_steps=min(50, recipe.val_every),
        num_sanity_val_steps=0, deterministic=False,
    ) | recipe.trainer_kwargs)
    last = ckpt_dir / "last.ckpt"
    with warnings.catch_warnings():
        # RandomWindows knows its exact length; the warning is about worker sharding.
        warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")
        trainer.fit(module, datamodule=data, ckpt_path=last if resume and last.is_file() else None)
    trainer.save_checkpoint(last, weights_only=False)  # full state: resumable
    val_loss = trainer.callback_metrics.get(VAL_LOSS)
    if val_loss is None or trainer.global_step % recipe.val_every:
        val_loss = trainer.validate(module, datamodule=data, verbose=False)[0][VAL_LOSS]
    return FitResult(float(val_loss), Path(log_dir), last, trainer.global_step)
