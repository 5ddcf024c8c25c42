"""The monitors under DDP on two CPU processes (gloo): every statistic covers the rows of
both ranks, merged over the processes at each logging step (a fixed amount per rank); rank
zero logs.

    python examples/ddp_cpu.py --steps 100
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from own_module import ByteLM
from text_windows import loaders

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    torch.manual_seed(0)
    train, val = loaders(batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
        logger=TensorBoardLogger(args.out, name="ddp_cpu"),
        callbacks=[LayerNormMonitor(), FinalNormInvarianceMonitor()],
        log_every_n_steps=min(25, args.steps), val_check_interval=min(50, args.steps),
        check_val_every_n_epoch=None, limit_val_batches=2, enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(ByteLM(), train, val)
    if trainer.is_global_zero:
        print(f"logs: {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
