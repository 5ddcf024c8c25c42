"""The train-tiny recipe as a LightningModule."""

from __future__ import annotations

import lightning as L
import torch

from lnmonitor.core.output.metric_names import TRAIN_LOSS, VAL_LOSS
from lnmonitor.tiny.data import CharVocab
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.recipe import DECAYS, SCHEDULES

__all__ = ["TinyGPTModule"]


class TinyGPTModule(L.LightningModule):
    """A :class:`TinyGPT` with the recipe's optimiser: AdamW with ``weight_decay`` on every parameter
    (``decay="all"``) or on the matrices only (``"matrices"``), and a one-cycle learning rate peaking at
    ``lr`` over ``max_steps`` (``schedule="constant"``: ``lr`` from step 0).  ``z_loss`` adds
    ``z_loss * mean(log Z^2)`` (Z the softmax's partition function) to the training objective, not to the
    logged loss.  ``forward(x, y=None)`` returns ``(logits, loss)``.  The vocabulary is a hyperparameter,
    so it travels with every checkpoint.
    """

    def __init__(self, vocab: str, width: int = 128, depth: int = 4, heads: int = 4, context: int = 64,
                 norm: str = "layer", eps: float = 1e-5, attention: str = "sdpa", lr: float = 3e-3,
                 weight_decay: float = 0.1, max_steps: int = 3000, decay: str = "all", init: str = "default",
                 qk_norm: bool = False, z_loss: float = 0.0, schedule: str = "one-cycle") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab = CharVocab(vocab)
        self.config = GPTConfig(vocab_size=len(self.vocab), width=width, depth=depth, heads=heads,
                                context=context, norm=norm, eps=eps, attention=attention, init=init,
                                qk_norm=qk_norm)
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.model = TinyGPT(self.config)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        return self.model(x, y)

    def objective(self, logits: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """What the optimiser minimises: the loss, plus the z-loss."""
        z_loss = self.hparams.get("z_loss", 0.0)
        if not z_loss:
            return loss
        return loss + z_loss * logits.float().logsumexp(dim=-1).square().mean()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        logits, loss = self(*batch)
        self.log(TRAIN_LOSS, loss, prog_bar=True)
        return self.objective(logits, loss)

    def validation_step(self, batch, batch_idx: int) -> None:
        _, loss = self(*batch)
        self.log(VAL_LOSS, loss, prog_bar=True, sync_dist=True, batch_size=batch[0].shape[0])

    def configure_optimizers(self):
        decay = self.hparams.weight_decay
        if self.hparams.decay == "all":
            groups = [{"params": list(self.parameters()), "weight_decay": decay}]
        else:
            groups = [{"params": [p for p in self.parameters() if p.dim() >= 2], "weight_decay": decay},
                      {"params": [p for p in self.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        if self.hparams.get("schedule", "one-cycle") == "constant":
            return optimizer
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr,
                                                       total_steps=self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
