"""Your own LightningModule, monitored as it is: ``forward(x)`` returns logits, the loss is
computed in ``training_step``, and both monitors run at their defaults.

    python examples/own_module.py --steps 300      # then: tensorboard --logdir runs/examples
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from text_windows import VOCAB, loaders
from torch import nn

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ByteLM(L.LightningModule):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    torch.manual_seed(0)
    train, val = loaders()
    trainer = L.Trainer(
        max_steps=args.steps, logger=TensorBoardLogger(args.out, name="own_module"),
        callbacks=[LayerNormMonitor(), FinalNormInvarianceMonitor()],
        log_every_n_steps=min(50, args.steps), val_check_interval=min(100, args.steps),
        check_val_every_n_epoch=None, limit_val_batches=4, enable_checkpointing=False,
    )
    trainer.fit(ByteLM(), train, val)
    print(f"logs: {trainer.logger.log_dir}\nopen with: tensorboard --logdir {args.out}")


if __name__ == "__main__":
    main()
