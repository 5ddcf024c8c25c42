"""ms per training step: the Lightning recipe against a bare PyTorch loop.

Three variants train the same model on the same batches, interleaved round by
round (``stepping.in_turns``) so that load from other processes hits all of them alike:

* ``lightning``: the train-tiny recipe through ``lnmonitor.tiny.train.fit``
  (monitors off, progress bar off), timed by a callback at each batch start;
* ``bare``: a hand-written loop with the same optimiser, schedule, clipping and
  batches, timed the same way (start of one step to the start of the next);
* ``explicit``: the bare loop on the model with explicit softmax attention.

Each round reports the median step time of every variant; the figures that
matter are the medians over rounds of the per-round ratios.

    python benchmarks/train_speed.py --rounds 5 --steps 60
    python benchmarks/train_speed.py --rounds 1 --steps 8 --warmup 2  # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import stepping
import torch

from lnmonitor.tiny.corpus import load_corpus
from lnmonitor.tiny.data import CharDataModule
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.recipe import Recipe
from lnmonitor.tiny.train import fit


def time_lightning(recipe: Recipe, text: str, warmup: int) -> float:
    """The recipe's median ms a step after ``warmup``, fitted through Lightning."""
    timer = stepping.StepTimer()
    with tempfile.TemporaryDirectory() as folder:
        fit(recipe, text, folder, callbacks=[timer], progress=False, resume=False)
    return 1000 * statistics.median(timer.gaps(warmup))


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
    timer = stepping.StepTimer()
    model.train()
    for x, y in data.train_dataloader():
        timer.starts.append(time.perf_counter())
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        schedule.step()
    timer.starts.append(time.perf_counter())
    return 1000 * statistics.median(timer.gaps(warmup))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="steps per variant per round")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each median")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 2 or args.rounds < 1:
        parser.error("need rounds >= 1 and steps > warmup + 2")
    text = load_corpus()
    recipe = Recipe(max_steps=args.steps, val_every=args.steps)
    variants = {
        "lightning": lambda: time_lightning(recipe, text, args.warmup),
        "bare": lambda: time_bare(recipe, text, args.warmup, "sdpa"),
        "explicit": lambda: time_bare(recipe, text, args.warmup, "explicit"),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds x {args.steps} steps per variant")
    ms = stepping.in_turns(lambda name, _: variants[name](), list(variants), args.rounds)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(ms[a], ms[b], strict=True))

    print("\n| measure | median ms/step | ratio (median over rounds) |\n|---|---|---|")
    for name in variants:
        print(f"| {name} | {statistics.median(ms[name]):.1f} | |")
    print(f"| Lightning / bare loop | | {ratio('lightning', 'bare'):.3f} (target <= 1.05) |")
    print(f"| SDPA / explicit attention | | {ratio('bare', 'explicit'):.3f} (target <= 1.00) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
