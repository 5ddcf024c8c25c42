"""The transformers.Trainer callback in one process or under ``torchrun --nproc_per_node 2``
(gloo on CPU, the Trainer's own accelerate set-up): the tiny GPT-2 of tests/test_three_callbacks.py on
the same 8 sequences per optimizer step, split over the processes.  Rank zero writes the
callback's history and the rows its last measured step merged to ``argv[1]`` as JSON."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch.distributed as dist
import transformers
from test_three_callbacks import LR, ROWS, STEPS, gpt2, labels, tokens

from lnmonitor.integrations.transformers import LNMonitorCallback


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    model = gpt2()
    data = [{"input_ids": x, "labels": y} for x, y in zip(tokens(), labels(tokens()), strict=True)]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=ROWS // world, max_steps=STEPS,
        learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, use_cpu=True,
        save_strategy="no", report_to=[], logging_steps=2, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    callback = LNMonitorCallback(trainer, keep_history=True, invariance_every_n_steps=None)
    trainer.add_callback(callback)
    trainer.train()
    if not dist.is_initialized() or dist.get_rank() == 0:
        rows = [s.rows for s in callback.last_result.row_stats]
        with open(out, "w") as f:
            json.dump({"world": world, "rows": rows, "history": callback.history}, f)


if __name__ == "__main__":
    main(sys.argv[1])
