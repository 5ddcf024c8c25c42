"""A plain PyTorch training loop in nanoGPT's shape -- ``iter_num`` from 0 to ``max_iters``
inclusive, gradient accumulation, AdamW, clipping, no framework -- monitored with the lines
marked ``# lnmonitor`` (docs/nanogpt.md has the same change as a diff of nanoGPT's own
``train.py``).  The tiny character GPT on the Python help text, random initialisation.

    python examples/plain_loop.py --max-iters 300     # then: tensorboard --logdir runs/examples
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
    parser.add_argument("--max-iters", "--steps", dest="max_iters", type=int, default=300,
                        help="the last iter_num (nanoGPT's max_iters: max_iters + 1 updates)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, width=128, depth=4, heads=4, context=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train, val = loaders(context=64, batch_size=16)
    batches = iter(train)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(train)
            return next(batches)

    writer = SummaryWriter(str(Path(args.out) / "plain_loop"))
    # lnmonitor: iter_num runs 0..max_iters inclusive, so max_iters + 1 steps; held-out rows to probe
    monitor = LoopMonitor(model, writer, every_n_steps=min(50, args.max_iters), max_steps=args.max_iters + 1,
                          probe_batch=next(iter(val)), invariance_every_n_steps=100)
    iter_num = 0
    X, Y = get_batch()
    while True:
        monitor.start(iter_num)  # lnmonitor: hooks on for the measured steps only
        for _ in range(args.accumulate):
            _, loss = model(X, Y)
            loss = loss / args.accumulate
            X, Y = get_batch()
            loss.backward()
            monitor.add_loss(loss)  # lnmonitor: the loss rule (loss_blowup) reads it at stop()
        monitor.stop()  # lnmonitor: the step's numbers, written; after the last, the summary
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        writer.add_scalar("train/loss", loss.item() * args.accumulate, iter_num)
        iter_num += 1
        if iter_num > args.max_iters:
            break
    writer.close()
    print(f"logs: {writer.log_dir}\nopen with: tensorboard --logdir {args.out}")


if __name__ == "__main__":
    main()
