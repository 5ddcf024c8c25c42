"""A plain PyTorch training loop in nanoGPT's shape -- gradient accumulation, AdamW, no
framework -- monitored with three added lines (marked ``# lnmonitor``).  The tiny
character GPT on the Python help text, random initialisation.

    python examples/plain_loop.py --steps 300     # then: tensorboard --logdir runs/examples
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from text_windows import VOCAB, loaders
from torch.utils.tensorboard import SummaryWriter

from lnmonitor.integrations.loop import LoopMonitor  # lnmonitor
from lnmonitor.tiny.model import GPTConfig, TinyGPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, width=128, depth=4, heads=4, context=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, _ = loaders(context=64, batch_size=16)
    batches = iter(train)
    writer = SummaryWriter(str(Path(args.out) / "plain_loop"))
    monitor = LoopMonitor(model, writer, every_n_steps=min(50, args.steps), max_steps=args.steps)  # lnmonitor
    for step in range(args.steps):
        with monitor.step(step):  # lnmonitor: hooks on for the measured steps only
            for _ in range(args.accumulate):
                try:
                    x, y = next(batches)
                except StopIteration:
                    batches = iter(train)
                    x, y = next(batches)
                _, loss = model(x, y)
                (loss / args.accumulate).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        writer.add_scalar("train/loss", loss.item(), step)
    writer.close()
    print(f"logs: {writer.log_dir}\nopen with: tensorboard --logdir {args.out}")


if __name__ == "__main__":
    main()
