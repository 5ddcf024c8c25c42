"""Stop a run when lnmonitor finds trouble, under Lightning, ``transformers.Trainer`` and a
plain loop.  Each trains at lr 0.1 without warm-up (the stability testbed's worst case,
docs/findings.md): the residual stream grows past 35x its start within a few steps, the
``stream_growth`` finding is raised (a ``lnmonitor.HealthWarning``; asked for explicitly,
``findings={"stream_growth": 35}``, so the example does the same whatever the defaults), and
``on_finding`` returns True, which stops the run long before ``--steps``.

    python examples/stop_on_finding.py --integration lightning  # or: trainer, loop
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from text_windows import VOCAB, loaders

from lnmonitor.tiny.model import GPTConfig, TinyGPT

FINDINGS = {"stream_growth": 35.0}  # the threshold docs/findings.md tested (growth over the fit's start)

LR = 0.1  # without warm-up: the testbed's lr1e-1-nowarmup


def on_finding(finding) -> bool:
    """What a user does with a finding: here, stop (return True). ``finding.kind``,
    ``finding.step``, ``finding.value`` and ``finding.message`` say what was seen."""
    print(f"stopping at step {finding.step}: {finding.kind} = {finding.value:.1f}")
    return True


def lightning(steps: int, out: Path) -> int:
    import lightning as L

    from lnmonitor import LayerNormMonitor

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyGPT(GPTConfig(vocab_size=VOCAB))

        def training_step(self, batch, batch_idx):
            return self.model(*batch)[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    monitor = LayerNormMonitor(every_n_steps=5, images=False, summary=True, findings=FINDINGS,
                               on_finding=on_finding)
    trainer = L.Trainer(max_steps=steps, callbacks=[monitor], default_root_dir=str(out), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), loaders(context=64, batch_size=16)[0])
    return trainer.global_step


def trainer(steps: int, out: Path) -> int:
    import transformers

    from lnmonitor.integrations.transformers import LNMonitorCallback

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=4,
                                                                  n_head=4, n_positions=64))
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "trainer")
    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=16, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, logging_steps=5,
    )
    records = [{"input_ids": x, "labels": x} for x, _ in loaders(context=64, batch_size=16)[0].dataset]
    hf = transformers.Trainer(model=model, args=args, train_dataset=records)
    hf.add_callback(LNMonitorCallback(hf, every_n_steps=5, invariance_every_n_steps=None,
                                      findings=FINDINGS, on_finding=on_finding))
    return hf.train().global_step


def loop(steps: int, out: Path) -> int:
    from lnmonitor.integrations.loop import LoopMonitor

    model = TinyGPT(GPTConfig(vocab_size=VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    monitor = LoopMonitor(model, every_n_steps=5, max_steps=steps, findings=FINDINGS, on_finding=on_finding)
    batches = iter(loaders(context=64, batch_size=16)[0])
    for step in range(steps):
        with monitor.step(step):
            model(*next(batches))[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if monitor.should_stop:  # on_finding returned True
            return step + 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--integration", choices=("lightning", "trainer", "loop"), default="lightning")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    torch.manual_seed(0)
    train = {"lightning": lightning, "trainer": trainer, "loop": loop}[args.integration]
    ran = train(args.steps, Path(args.out))
    print(f"{args.integration}: trained {ran} of {args.steps} steps")


if __name__ == "__main__":
    main()
