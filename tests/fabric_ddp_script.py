"""A plain loop under Lightning Fabric, with LoopMonitor on the model Fabric hands back: one
process, or each of the processes torchrun starts (DDP over gloo) with its share of the rows.
Writes what rank zero measured to the JSON file named by argv[1]."""

import json
import sys

import lightning as L
import torch

from lnmonitor.integrations.loop import LoopMonitor
from lnmonitor.tiny.model import GPTConfig, TinyGPT

world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
fabric = L.Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
fabric.launch()  # under torchrun: this process is one of the ranks already
torch.manual_seed(0)
model = TinyGPT(GPTConfig(vocab_size=16, width=16, depth=2, heads=2, context=8))
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
rows = torch.randint(0, 16, (8, 8), generator=torch.Generator().manual_seed(1))
mine = rows.chunk(world)[fabric.global_rank]
probe = (rows[:2], rows[:2])
monitor = LoopMonitor(model, every_n_steps=1, max_steps=2, probe_batch=probe, invariance_every_n_steps=1,
                      keep_history=True, summary=False)
for step in range(2):
    monitor.start(step)
    _, loss = model(mine, mine)
    fabric.backward(loss)
    monitor.stop()
    optimizer.step()
    optimizer.zero_grad()
if fabric.global_rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"world": world, "history": monitor.history, "off": monitor.off_reason,
                   "invariance_off_reason": monitor.invariance_off_reason,
                   "rows": [s.rows for s in monitor.last_result.row_stats]}, f)
