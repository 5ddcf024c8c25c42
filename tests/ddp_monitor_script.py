"""Run by tests/test_monitor_ddp.py: fit a tiny GPT with LayerNormMonitor on ``devices``
CPU processes (``ddp`` with gloo when more than one) on one fixed global batch of 8
windows per step, and write rank zero's history and the number of collectives as JSON.

Usage: python tests/ddp_monitor_script.py DEVICES OUT.json
"""

from __future__ import annotations

import json
import sys
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lnmonitor import LayerNormMonitor
from lnmonitor.tiny.module import TinyGPTModule

GLOBAL_BATCH, CONTEXT, STEPS = 8, 16, 2
VOCAB = "".join(chr(c) for c in range(32, 97))  # 65 symbols


class Windows(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, len(VOCAB), (GLOBAL_BATCH * STEPS, CONTEXT), generator=g)
        self.y = torch.randint(0, len(VOCAB), (GLOBAL_BATCH * STEPS, CONTEXT), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Data(L.LightningDataModule):
    """Sample i goes to rank i % world (no shuffling): the ranks' micro-batches together
    are exactly the single process's batch."""

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(Windows(), num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(Windows(), batch_size=GLOBAL_BATCH // world, sampler=sampler)


class Counting(LayerNormMonitor):
    collectives = 0

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        gather = trainer.strategy.all_gather

        def counted(*args, **kwargs):
            Counting.collectives += 1
            return gather(*args, **kwargs)

        trainer.strategy.all_gather = counted


def main() -> None:
    devices, out = int(sys.argv[1]), sys.argv[2]
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    module = TinyGPTModule(VOCAB, width=32, depth=2, heads=2, context=CONTEXT, max_steps=STEPS)
    monitor = Counting(every_n_steps=1, keep_history=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_steps=STEPS, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[monitor], limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=Data())
    if trainer.is_global_zero:
        rows = [s.rows for s in monitor.last_summaries]
        with open(out, "w") as f:
            json.dump({"history": monitor.history, "collectives": Counting.collectives,
                       "rows": rows, "world": trainer.world_size}, f)


if __name__ == "__main__":
    main()
