"""Run by tests/test_distributed.py (CPU, gloo) and tests/test_cuda.py (one GPU): fit a
tiny GPT, or a transformers GPT-2 from a small config, with both monitors on ``devices``
processes on one fixed global batch of 8 windows per step, and write rank zero's
histories and the number of merges over processes as JSON.  ``STRATEGY`` is ``ddp``, ``fsdp1``
(Lightning's FSDPStrategy, every block wrapped), ``fsdp2`` (ModelParallelStrategy with
``fully_shard`` applied to every block and the model in ``configure_model``) or
``fsdp2-norms`` (the same, and every norm a unit of its own first: ``fully_shard(norm)``,
the final norm grouped with the head as torchtitan does); ``tp`` is ModelParallelStrategy's
tensor parallelism over all ``DEVICES`` with sequence-parallel norms (DTensor inputs sharded
along the sequence), ``tp-replicated`` the same without sequence parallelism (every norm's input
the same on every rank), ``fsdp2-tp`` a 2-D mesh: ``DEVICES // 2`` data-parallel ranks, each
FSDP2 over a tensor-parallel pair laid out as ``tp`` (with one device, ``tp`` lays the model out
on a mesh of one rank: DTensor activations without a partner); ``deepspeed2`` and ``deepspeed3`` are
Lightning's ``DeepSpeedStrategy`` at ZeRO stage 2 and 3 (on the CPU without its CUDA check:
:func:`deepspeed`).

Usage: python tests/distributed_monitor_script.py STRATEGY DEVICES OUT.json [cpu|cuda] [tiny|gpt2]
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.core.meter import meter as meter_module
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
    """Sample i goes to data-parallel rank i % world (no shuffling): the ranks' micro-batches
    together are exactly the single process's batch."""

    def train_dataloader(self) -> DataLoader:
        # the data-parallel rank and size: tensor-parallel ranks share one shard of the batch
        strategy = self.trainer.strategy
        shard = getattr(strategy, "distributed_sampler_kwargs", None) or dict(num_replicas=1, rank=0)
        sampler = DistributedSampler(Windows(), shuffle=False, **shard)
        return DataLoader(Windows(), batch_size=GLOBAL_BATCH // shard["num_replicas"], sampler=sampler)


class Counting(LayerNormMonitor):
    """Counts the measured steps merged over processes (each merge: three collectives)."""

    merges = 0

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        merge = meter_module.merge_processes

        def counted(*args, **kwargs):
            Counting.merges += 1
            return merge(*args, **kwargs)

        meter_module.merge_processes = counted


class ShardedGPT(TinyGPTModule):
    """The tiny GPT sharded with FSDP2 when the strategy gives it a device mesh: every block a
    unit, and with ``norm_units`` every norm in a block its own unit too and the final norm
    grouped with the head (torchtitan's ``fully_shard([model.norm, model.output])``)."""

    norm_units = False

    def blocks(self):
        return self.model.blocks

    def norm_groups(self):
        return [[norm] for block in self.blocks() for norm in (block.ln1, block.ln2)] + [
            [self.model.lnf, self.model.head]]

    sequence_parallel_norms = True
    loss_parallel = False  # the head's logits sharded over the vocabulary (torchtitan's loss_parallel)

    def configure_optimizers(self):
        # AdamW's plain loop: a tensor-parallel plan leaves some parameters plain tensors beside the
        # DTensors, which the multi-tensor (foreach) AdamW, CUDA's default, refuses to mix (the plain
        # loop is CPU's default: the CPU runs are unchanged)
        config = super().configure_optimizers()
        for group in (config["optimizer"] if isinstance(config, dict) else config).param_groups:
            group["foreach"] = False
        return config

    def configure_model(self) -> None:
        if self.device_mesh is None:  # not under ModelParallelStrategy
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        if getattr(self, "plan_tp", False):  # a tensor-parallel plan, on a mesh of one rank too
            self.tensor_parallel(self.device_mesh["tensor_parallel"])
            if mesh.size() == 1:
                return
        for group in self.norm_groups() if self.norm_units else ():
            fully_shard(group, mesh=mesh)
        for block in self.blocks():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def tensor_parallel(self, mesh) -> None:
        """torchtitan's Llama plan in the shape the tiny GPT allows: the embedding's vocabulary
        sharded (``RowwiseParallel``), the MLP colwise then rowwise, the head colwise.  With
        ``sequence_parallel_norms`` every norm is ``SequenceParallel`` (its input a DTensor
        sharded along the sequence; the stream is sharded from the first block on and gathered
        for attention, whose fused qkv does not split by columns, and for the MLP and the head);
        without, every norm reads the same replicated stream on every rank.  With
        ``loss_parallel`` the head's logits stay a DTensor sharded over the vocabulary, as
        torchtitan's are (the loss must then be computed under ``loss_parallel()``)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        sp = self.sequence_parallel_norms
        stream = Shard(1) if sp else Replicate()
        plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "head": ColwiseParallel(input_layouts=stream,
                                        output_layouts=Shard(-1) if self.loss_parallel else Replicate(),
                                        use_local_output=not self.loss_parallel)}
        for i in range(len(self.blocks())):
            plan |= {f"blocks.{i}.mlp.fc": ColwiseParallel(input_layouts=stream),
                     f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=stream)}
        if sp:
            plan |= {"blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                                    use_local_output=True),
                     "lnf": SequenceParallel()}
            for i in range(len(self.blocks())):
                plan |= {f"blocks.{i}.ln1": SequenceParallel(), f"blocks.{i}.ln2": SequenceParallel(),
                         f"blocks.{i}.attn": PrepareModuleInput(input_layouts=Shard(1),
                                                                desired_input_layouts=Replicate(),
                                                                use_local_output=True),
                         f"blocks.{i}.attn.proj": PrepareModuleOutput(output_layouts=Replicate(),
                                                                      desired_output_layouts=Shard(1),
                                                                      use_local_output=True)}
        parallelize_module(self.model, mesh, plan)


class GPT2(L.LightningModule):
    """A transformers GPT-2 from a small config, wrapped the usual way (no ``forward``)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=len(VOCAB), n_embd=32, n_layer=2, n_head=2,
                                         n_positions=CONTEXT, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(input_ids=x, labels=y).loss

    def blocks(self):
        return self.model.transformer.h

    def norm_groups(self):
        return [[m] for m in self.model.modules() if isinstance(m, torch.nn.LayerNorm)]

    norm_units = False
    configure_model = ShardedGPT.configure_model

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def deepspeed(stage: int, accelerator: str):
    """Lightning's ``DeepSpeedStrategy`` at ZeRO ``stage``, every parameter partitioned at stage 3
    (``stage3_param_persistence_threshold`` 0).  On the CPU (gloo) without its one CUDA check:
    Lightning refuses any accelerator but CUDA in ``setup_environment`` ("The DeepSpeed strategy is
    only supported on CUDA GPUs"), before any callback runs; DeepSpeed's own CPU accelerator does the rest."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeed(DeepSpeedStrategy):
        def setup_environment(self) -> None:  # no CUDA check
            DDPStrategy.setup_environment(self)

    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    if accelerator == "cpu":
        # devices with an index (cpu:0, cpu:1): DeepSpeed's engine and Lightning read the local rank from it
        devices = [torch.device("cpu", i) for i in range(int(os.environ.get("WORLD_SIZE", "2")))]
        return CPUDeepSpeed(config=config, process_group_backend="gloo", parallel_devices=devices)
    return DeepSpeedStrategy(config=config)


def main() -> None:
    strategy, devices, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    accelerator = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    model = sys.argv[5] if len(sys.argv) > 5 else "tiny"
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if model == "gpt2":
        module = GPT2()
    else:
        module = ShardedGPT(VOCAB, width=32, depth=2, heads=2, context=CONTEXT, max_steps=STEPS)
    monitor = Counting(every_n_steps=1, keep_history=True)
    probe = tuple(t[:4] for t in Windows()[:4])
    invariance = FinalNormInvarianceMonitor(invariance_every_n_steps=1, on_validation=False,
                                            probe_batch=probe, keep_history=True, scales=(1.0, 0.1, 0.01))
    module.norm_units = strategy == "fsdp2-norms"
    module.sequence_parallel_norms = strategy != "tp-replicated"
    module.plan_tp = strategy in ("tp", "tp-replicated", "fsdp2-tp")
    if module.plan_tp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        tp = 2 if strategy == "fsdp2-tp" else devices
        chosen = ModelParallelStrategy(data_parallel_size=devices // tp, tensor_parallel_size=tp)
    elif strategy.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        chosen = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    elif strategy.startswith("deepspeed"):
        chosen = deepspeed(int(strategy[-1]), accelerator)
    elif strategy == "fsdp1":
        from lightning.pytorch.strategies import FSDPStrategy

        blocks = {type(b) for b in module.blocks()}
        chosen = FSDPStrategy(auto_wrap_policy=blocks)
    else:
        chosen = "ddp" if devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=chosen,
        max_steps=STEPS, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, callbacks=[monitor, invariance], limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=Data())
    if trainer.is_global_zero:
        rows = [s.rows for s in monitor.last_row_stats]
        with open(out, "w") as f:
            json.dump({"history": monitor.history, "merges": Counting.merges,
                       "invariance": invariance.history, "disabled": invariance.off_reason,
                       "rows": rows, "world": trainer.world_size, "steps": trainer.global_step,
                       "off": monitor.off_reason or monitor.meter.off_reason}, f)


if __name__ == "__main__":
    main()
