"""Run by tests/test_robustness.py: a 2-process gloo DDP fit of a tiny GPT whose ranks get
uneven data -- rank 0 trains on batches of 4 and 4 windows, rank 1 on 4 and 3 (its last
batch is short), and rank 1 has one validation batch where rank 0 has two -- with
LayerNormMonitor and FinalNormInvarianceMonitor attached.  Rank zero writes the rows
measured per step (all ranks together) and the histories as JSON to OUT.json; every rank
writes its final global step to OUT.json.rank<r>.

Usage: python tests/ddp_uneven_script.py OUT.json
"""

from __future__ import annotations

import json
import sys
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.tiny.module import TinyGPTModule

CONTEXT = 16
VOCAB = "".join(chr(c) for c in range(32, 97))  # 65 symbols


class Fixed(Sampler):
    def __init__(self, indices):
        self.indices = list(indices)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def windows(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, len(VOCAB), (n, CONTEXT), generator=g),
                         torch.randint(0, len(VOCAB), (n, CONTEXT), generator=g))


class Data(L.LightningDataModule):
    def train_dataloader(self):
        rank = self.trainer.global_rank
        share = range(0, 8) if rank == 0 else range(8, 15)  # 8 and 7 windows
        return DataLoader(windows(15, 0), batch_size=4, sampler=Fixed(share))

    def val_dataloader(self):
        rank = self.trainer.global_rank
        share = range(0, 8) if rank == 0 else range(8, 11)  # 2 batches and 1
        return DataLoader(windows(11, 1), batch_size=4, sampler=Fixed(share))


class Recording(LayerNormMonitor):
    rows: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = self.monitor.measuring
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if step is not None and self.monitor.measuring is None:
            Recording.rows[step] = [s.rows for s in self.last_row_stats]


def main() -> None:
    out = sys.argv[1]
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    module = TinyGPTModule(VOCAB, width=32, depth=1, heads=2, context=CONTEXT, max_steps=2)
    monitor = Recording(every_n_steps=1, keep_history=True)
    inv = FinalNormInvarianceMonitor(invariance_every_n_steps=1, keep_history=True, scales=(1.0, 1e-2))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[monitor, inv], num_sanity_val_steps=0, use_distributed_sampler=False,
        val_check_interval=2, check_val_every_n_epoch=None,
    )
    trainer.fit(module, datamodule=Data())
    with open(f"{out}.rank{trainer.global_rank}", "w") as f:  # this rank got to the end
        json.dump({"step": trainer.global_step}, f)
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump({
                "rows": Recording.rows, "history": monitor.history,
                "invariance_steps": [h["step"] for h in inv.history],
            }, f)


if __name__ == "__main__":
    main()
