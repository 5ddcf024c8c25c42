"""Run by tests/test_distributed.py (CPU, gloo): the tiny GPT of
tests/distributed_monitor_script.py in a plain training loop with :class:`LoopMonitor`, on
``DEVICES`` processes started here.  With more than one, the model is laid out by
``parallelize_module`` as that script's ``tp`` (every norm ``SequenceParallel``) over all of
them, the head's logits sharded over the vocabulary and the loss computed under
``loss_parallel()`` as torchtitan does, each rank running the whole global batch; with one, it
is the plain model.  After the
monitor's final-norm invariance probe runs at every step on every rank (a tensor-parallel forward is
a collective).  Rank zero writes the monitor's history, each norm's rows, the probe's
metrics and what was said as JSON.

Usage: python tests/tp_loop_script.py DEVICES OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_monitor_script import CONTEXT, GLOBAL_BATCH, STEPS, VOCAB, ShardedGPT, Windows

from lnmonitor.integrations.loop import LoopMonitor


def main(rank: int, devices: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    if devices > 1:
        dist.init_process_group("gloo", rank=rank, world_size=devices)
    torch.manual_seed(0)
    module = ShardedGPT(VOCAB, width=32, depth=2, heads=2, context=CONTEXT, max_steps=STEPS)
    model = module.model
    if devices > 1:
        from torch.distributed.device_mesh import init_device_mesh

        module.loss_parallel = True
        module.tensor_parallel(init_device_mesh("cpu", (devices,)))
    from torch.distributed.tensor.parallel import loss_parallel

    parallel_loss = loss_parallel if devices > 1 else nullcontext

    def loss_fn(model, batch):
        with parallel_loss():
            return model(*batch)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Windows()
    monitor = LoopMonitor(model, every_n_steps=1, max_steps=STEPS, keep_history=True, final_norm="lnf",
                          probe_batch=(data.x[:4], data.y[:4]), loss_fn=loss_fn, invariance_every_n_steps=1)
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)  # every rank the global batch
        x, y = data.x[rows], data.y[rows]
        with monitor.step(step), parallel_loss():
            _, loss = model(x, y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"history": monitor.history, "world": devices, "off": monitor.off_reason,
                       "rows": [s.rows for s in monitor.last_result.row_stats],
                       "invariance": monitor.last_invariance and monitor.last_invariance.metrics(),
                       "disabled": monitor.invariance_off_reason},
                      f)
    if devices > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    n, path = int(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if n == 1:
        main(0, 1, path)
    else:
        mp.spawn(main, args=(n, path), nprocs=n)
