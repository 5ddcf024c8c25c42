"""ms per training step: the Lightning recipe against a bare PyTorch loop.

Three variants train the same model on the same batches, interleaved round by
round so that load from other processes hits all of them alike:

* ``lightning``: the train-tiny recipe through ``lnmonitor.tiny.train.fit``
  (monitors off, progress bar off), timed by a callback at each batch start;
* ``bare``: a hand-written loop with the same optimiser, schedule, clipping and
  batches, timed the same way (start of one step to the start of the next);
* ``explicit``: the bare loop on the model with explicit softmax attention.

Each round reports the median step time of every variant; the figures that
matter are the medians over rounds of the per-round ratios.

    python benchmarks/train_speed.py --rounds 5 --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from itertools import pairwise

import torch
from lightning.pytorch.callbacks import Callback

from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.data import CharDataModule
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit


class StepTimer(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())


def median_step_ms(starts: list[float], warmup: int) -> float:
    gaps = [b - a for a, b in pairwise(starts[warmup:])]
    return 1000 * statistics.median(gaps)


def time_lightning(recipe: Recipe, text: str, warmup: int) -> float:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as folder:
        fit(recipe, text, folder, callbacks=[timer], progress=False, resume=False)
    return median_step_ms(timer.starts, warmup)


def time_bare(recipe: Recipe, text: str, warmup: int, attention: str) -> float:
    """The recipe's training step written out by hand on the same batch stream."""
    torch.manual_seed(recipe.seed)
    data = CharDataModule(text, context=recipe.context, batch_size=recipe.batch_size,
                          seed=recipe.seed, max_steps=recipe.max_steps)
    model = TinyGPT(GPTConfig(
        vocab_size=len(data.vocab), width=recipe.width, depth=recipe.depth, heads=recipe.heads,
        context=recipe.context, norm=recipe.norm, eps=recipe.eps, attention=attention,
    ))
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": recipe.weight_decay},
         {"params": others, "weight_decay": 0.0}], lr=recipe.lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.lr, total_steps=recipe.max_steps)
    starts = []
    model.train()
    for x, y in data.train_dataloader():
        starts.append(time.perf_counter())
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        schedule.step()
    starts.append(time.perf_counter())
    return median_step_ms(starts, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each median")
    args = parser.parse_args()
    if args.steps <= args.warmup + 2 or args.rounds < 1:
        parser.error("need rounds >= 1 and steps > warmup + 2")
    text = load_corpus()
    recipe = Recipe(max_steps=args.steps, val_every=args.steps)
    variants = {
        "lightning": lambda: time_lightning(recipe, text, args.warmup),
        "bare": lambda: time_bare(recipe, text, args.warmup, "sdpa"),
        "explicit": lambda: time_bare(recipe, text, args.warmup, "explicit"),
    }
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds x {args.steps} steps per variant")
    for round_index in range(args.rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        ms = {name: variants[name]() for name in order}
        rows.append(ms)
        print(f"round {round_index + 1}: " + "  ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    lightning_vs_bare = statistics.median(r["lightning"] / r["bare"] for r in rows)
    sdpa_vs_explicit = statistics.median(r["bare"] / r["explicit"] for r in rows)
    print("\n| measure | median ms/step | ratio (median over rounds) |\n|---|---|---|")
    for name in variants:
        print(f"| {name} | {statistics.median(r[name] for r in rows):.1f} | |")
    print(f"| Lightning / bare loop | | {lightning_vs_bare:.3f} (target <= 1.05) |")
    print(f"| SDPA / explicit attention | | {sdpa_vs_explicit:.3f} (target <= 1.00) |")


if __name__ == "__main__":
    main()
