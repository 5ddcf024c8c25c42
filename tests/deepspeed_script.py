"""Run by tests/test_deepspeed.py under ``torchrun`` (CPU, gloo): an lnmonitor integration around a model
that DeepSpeed trains, or the same under plain DDP, on one fixed global batch split over the
processes; rank zero writes what the monitor logged and what DeepSpeed did as JSON.

``INTEGRATION`` is ``loop`` (:class:`LoopMonitor` around ``engine.module`` of ``deepspeed.initialize``, the
tiny GPT of tests/distributed_monitor_script.py, the invariance probe at every step) or ``trainer``
(:class:`LNMonitorCallback` in a ``transformers.Trainer`` with ``TrainingArguments(deepspeed=...)``,
the tiny GPT-2 of tests/test_three_callbacks.py as tests/hf_ddp_script.py trains it).  ``MODE`` is ``ddp``,
``zero2``, ``zero3`` (the default ``stage3_param_persistence_threshold``: parameters this small are
gathered at the first forward and kept whole) or ``zero3-partitioned`` (the threshold 0: every
parameter, the norms' too, partitioned outside its module's forward).

Usage: python -m torch.distributed.run --nproc_per_node 2 tests/deepspeed_script.py OUT.json INTEGRATION MODE
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

from lnmonitor.core import zero3

PARTITIONED = "zero3-partitioned"


def config(mode: str, micro_batch: int) -> dict | None:
    """The DeepSpeed config of ``mode`` (None: DDP): fp32 on the CPU, the user's torch optimizer."""
    if mode == "ddp":
        return None
    zero = {"stage": 2 if mode == "zero2" else 3}
    if mode == PARTITIONED:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True}


class Gathers:
    """How many times lnmonitor gathered a partitioned ZeRO-3 parameter, by where (the float64 check
    when the norms are found; a gain or bias read in a forward hook), counted around the real
    functions of :mod:`lnmonitor.core.zero3`."""

    def __init__(self) -> None:
        self.found, self.read = 0, 0
        gathered, whole = zero3.gathered, zero3.whole

        def counted_gathered(module):
            self.found += any(zero3.partitioned(p) for p in module.parameters())
            return gathered(module)

        def counted_whole(t):
            self.read += zero3.partitioned(t)
            return whole(t)

        zero3.gathered, zero3.whole = counted_gathered, counted_whole


def norm_parameters(model: torch.nn.Module) -> dict[str, dict]:
    """Each norm parameter's size as the module holds it, its whole size and ZeRO-3 status."""
    return {name: {"held": p.numel(), "whole": int(getattr(p, "ds_numel", p.numel())),
                   "status": getattr(getattr(p, "ds_status", None), "name", None)}
            for name, p in model.named_parameters() if "ln" in name.split(".")[-2]}


def loop(mode: str, world: int, rank: int) -> dict:
    from distributed_monitor_script import CONTEXT, GLOBAL_BATCH, STEPS, VOCAB, Windows

    from lnmonitor.integrations.loop import LoopMonitor
    from lnmonitor.tiny.module import TinyGPTModule

    torch.manual_seed(0)
    model = TinyGPTModule(VOCAB, width=32, depth=2, heads=2, context=CONTEXT, max_steps=STEPS).model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "ddp":
        engine = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    else:
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                       config=config(mode, GLOBAL_BATCH // world))
    before = norm_parameters(model)
    data = Windows()
    # the engine itself under ZeRO-3 by default (its module inside is found), else what it wraps
    given = engine if mode in ("ddp", "zero3") else engine.module
    monitor = LoopMonitor(given, every_n_steps=1, max_steps=STEPS, keep_history=True, images=False,
                          summary=False, probe_batch=(data.x[:4], data.y[:4]), invariance_every_n_steps=1)
    for step in range(STEPS):
        rows = slice(step * GLOBAL_BATCH + rank, (step + 1) * GLOBAL_BATCH, world)  # a DistributedSampler's
        with monitor.step(step):
            _, loss = engine(data.x[rows], data.y[rows])
            if mode == "ddp":
                loss.backward()
            else:
                engine.backward(loss)
        if mode == "ddp":
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.step()
    return {"history": monitor.history, "off": monitor.off_reason or monitor.meter.off_reason,
            "rows": [s.rows for s in monitor.last_result.row_stats],
            "disabled": monitor.invariance_off_reason,
            "invariance": monitor.last_invariance and monitor.last_invariance.metrics(),
            "before": before, "after": norm_parameters(model),
            # each norm's gain read after training, outside any forward (gathered where partitioned)
            "gains": {n.name: n.gain().double().sum().item() for n in monitor.meter.norms}}


def trainer(mode: str, world: int, rank: int) -> dict:
    import transformers
    from test_three_callbacks import LR, ROWS, STEPS, gpt2, labels, tokens

    from lnmonitor.integrations.transformers import LNMonitorCallback

    model = gpt2()
    data = [{"input_ids": x, "labels": y} for x, y in zip(tokens(), labels(tokens()), strict=True)]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=ROWS // world, max_steps=STEPS,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        use_cpu=True, save_strategy="no", report_to=[], logging_steps=2, logging_first_step=True,
        disable_tqdm=True, dataloader_num_workers=0, deepspeed=config(mode, ROWS // world))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    callback = LNMonitorCallback(trainer, keep_history=True, invariance_every_n_steps=2, summary=False)
    trainer.add_callback(callback)
    trainer.train()
    return {"history": callback.history, "off": callback.off_reason or callback.meter.off_reason,
            "rows": [s.rows for s in callback.last_result.row_stats],
            "disabled": callback.invariance_off_reason,
            "after": norm_parameters(trainer.model), "engine": type(trainer.model_wrapped).__name__}


def main(out: str, integration: str, mode: str) -> None:
    warnings.filterwarnings("ignore")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if mode != "ddp":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif world > 1 and integration == "loop":  # the Trainer sets up its own
        dist.init_process_group("gloo")
    gathers = Gathers()
    result = (loop if integration == "loop" else trainer)(mode, world, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({**result, "world": world, "gathers": vars(gathers)}, f)
    if dist.is_initialized():  # every rank ends together (a rank leaving gloo early aborts the other)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
