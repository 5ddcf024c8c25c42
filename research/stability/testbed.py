"""The stability testbed: tiny-recipe runs made to go wrong on purpose, and healthy controls.

Each configuration of :data:`TESTBED` is the train-tiny recipe with a few options changed
(learning rate with and without warm-up, eps 1e-5 / 1e-1 at both initialisations, weight
decay on and off, QK-norm on and off, and Wortsman et al.'s late output-logit divergence with
z-loss as its control).  One run trains it for its steps in a plain loop (the recipe's model,
optimiser, schedule, gradient clipping and batches, without Lightning: cheaper, and every
step's loss is at hand) and records:

* every step's training loss (cross-entropy, nats/char) and gradient norm before clipping;
* on every ``measure_every``-th step, the candidate signals
  (:func:`research.stability.candidate_signals.candidate_signals`: the meter's ladder and the
  :class:`~research.stability.scales.ScaleTap`'s attention and output logits, per layer too);
* the validation loss every ``val_every`` steps on the fixed held-out windows, and at the end.

Records go to ``<out>/<config>/seed=<seed>/result.json`` (written atomically: its presence
means the run finished, and it is never rerun unless ``force``).  A run is short (tens of
seconds), so an interrupted one restarts from its first step.  ``jobs`` runs that many side by
side in worker processes, one torch thread each.  What
the records mean (the events, the lead times, the peers' rules on the same losses) is
:mod:`research.stability.table`'s.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

from lnmonitor.core.output.files import atomic_write_json, read_json
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps.grid import data_fingerprint
from lnmonitor.tiny.recipe import Recipe

__all__ = ["DEFAULT_OUT", "TESTBED", "Config", "record_path", "run_config", "run_testbed", "testbed_runs"]

DEFAULT_OUT = Path("runs/stability")
RECORD = "result.json"
FORMAT = 1


@dataclass(frozen=True)
class Config:
    """One testbed configuration: ``recipe`` (its seed is replaced per run), the ``group`` whose
    best final validation loss defines damage (with the same lr schedule:
    :func:`research.stability.table.run_group`), ``healthy`` (the control expected to train well:
    its alarms are false alarms unless an event happened), and what it is for."""

    name: str
    recipe: Recipe
    group: str
    healthy: bool
    why: str
    seeds: tuple[int, ...] = (0, 1)
    measure_every: int = 5
    extra: dict = field(default_factory=dict)


def _short(**options) -> Recipe:
    """The testbed's base: the tiny recipe at batch 16, 300 steps, validation every 50."""
    return Recipe(batch_size=16, max_steps=300, val_every=50, **options)


def _late(**options) -> Recipe:
    """The late-divergence base: width 64, no weight decay, constant lr, 1,000 steps."""
    return Recipe(batch_size=16, max_steps=1000, val_every=100, width=64, weight_decay=0.0,
                  schedule="constant", **options)


_RUNS = [
    ("lr3e-3", _short(lr=3e-3), True, "the recipe's lr with its one-cycle warm-up: the healthy control"),
    ("lr1e-2", _short(lr=1e-2), True, "3x the lr, with warm-up"),
    ("lr3e-2", _short(lr=3e-2), False, "10x the lr, with warm-up"),
    ("lr1e-1", _short(lr=1e-1), False, "33x the lr, with warm-up"),
    ("lr3e-3-nowarmup", _short(lr=3e-3, schedule="constant"), True, "the recipe's lr from step 0"),
    ("lr1e-2-nowarmup", _short(lr=1e-2, schedule="constant"), False, "issue 28's 70x ladder"),
    ("lr3e-2-nowarmup", _short(lr=3e-2, schedule="constant"), False, "issue 28's 1,000x ladder"),
    ("lr1e-1-nowarmup", _short(lr=1e-1, schedule="constant"), False, "issue 28's 60,000x ladder"),
    ("eps1e-1", _short(eps=1e-1), True, "eps 0.1 at the default init: no cost in the eps grid"),
    ("gpt2", _short(init="gpt2"), True, "GPT-2's init at eps 1e-5"),
    ("gpt2-eps1e-1", _short(init="gpt2", eps=1e-1), False, "eps 0.1 at GPT-2 init: eps/var 130, a cost"),
    ("wd0", _short(weight_decay=0.0), True, "no weight decay at the recipe's lr"),
    ("wd0-lr1e-2-nowarmup", _short(weight_decay=0.0, lr=1e-2, schedule="constant"), False,
     "no weight decay, 3x the lr from step 0"),
    ("qk-lr1e-2-nowarmup", _short(lr=1e-2, schedule="constant", qk_norm=True), False,
     "QK-norm at 3x the lr from step 0 (control of lr1e-2-nowarmup)"),
    ("qk-lr3e-2-nowarmup", _short(lr=3e-2, schedule="constant", qk_norm=True), False,
     "QK-norm at 10x the lr from step 0 (control of lr3e-2-nowarmup)"),
]
_LATE = [
    ("late-lr1e-2", _late(lr=1e-2), False, "Wortsman's output-logit divergence: no wd, high lr, long"),
    ("late-lr1e-2-zloss", _late(lr=1e-2, z_loss=1e-4), False, "its control: z-loss 1e-4"),
]
TESTBED: dict[str, Config] = {
    name: Config(name, recipe, "width128-300", healthy, why) for name, recipe, healthy, why in _RUNS
}
TESTBED.update({
    name: Config(name, recipe, "width64-late", healthy, why, seeds=(0,), measure_every=10)
    for name, recipe, healthy, why in _LATE
})


def record_path(out: Path, name: str, seed: int) -> Path:
    return Path(out) / name / f"seed={seed}" / RECORD


def _val_loss(model, batches) -> float:
    import torch

    with torch.no_grad():
        losses = [float(model(x, y)[1]) for x, y in batches]
    return sum(losses) / len(losses)


def run_config(config: Config, seed: int, text: str) -> dict:
    """Train ``config`` at ``seed`` and return its record (see the module docstring)."""
    import torch

    from lnmonitor.core.meter.meter import LadderMeter
    from lnmonitor.tiny.data import CharDataModule, RandomWindows
    from lnmonitor.tiny.module import TinyGPTModule
    from research.stability.candidate_signals import candidate_signals
    from research.stability.scales import ScaleTap

    recipe = replace(config.recipe, seed=seed)
    started = time.process_time()
    torch.manual_seed(seed)
    data = CharDataModule(text, context=recipe.context, batch_size=recipe.batch_size, seed=seed,
                          max_steps=recipe.max_steps)
    module = TinyGPTModule(**recipe.module_kwargs(data.vocab.chars))
    optim = module.configure_optimizers()
    optimizer, schedule = (optim, None) if not isinstance(optim, dict) else \
        (optim["optimizer"], optim["lr_scheduler"]["scheduler"])
    val = data.val_batches()
    meter, tap = LadderMeter(module.model, info=lambda _: None), ScaleTap()
    losses, grad_norms, measured, curve = [], [], [], []
    windows = RandomWindows(data.train_tokens, recipe.context, recipe.batch_size, seed, recipe.max_steps)
    for step, (x, y) in enumerate(windows):
        on = step % config.measure_every == 0
        if on:
            meter.start()
            tap.start()
        logits, loss = module(x, y)
        module.objective(logits, loss).backward()
        if on:
            tap.stop()
            meter.stop()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), recipe.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
        grad_norms.append(float(norm))
        if on:
            result, scales = meter.result(), tap.result()
            signals = candidate_signals(result.figures if result else None, scales)
            signals["step"] = step
            signals["attention_per_layer"] = scales.attention if scales else []
            signals["inv_sigma_rungs"] = [f.inv_sigma for f in result.figures.norms
                                          if f.name in result.figures.rungs] if result else []
            measured.append(signals)
        if (step + 1) % recipe.val_every == 0:
            curve.append([step, _val_loss(module.model, val[:4])])
        if not math.isfinite(losses[-1]):
            break  # a non-finite loss is divergence: nothing after it means anything
    final = _val_loss(module.model, val[:16])
    return {
        "format": FORMAT, "config": config.name, "seed": seed, "group": config.group,
        "healthy": config.healthy, "why": config.why, "recipe": recipe.to_dict(),
        "measure_every": config.measure_every, "data": data_fingerprint(text),
        "loss": losses, "grad_norm": grad_norms, "measured": measured, "val": curve,
        "final_val_loss": final, "steps": len(losses), "cpu_seconds": time.process_time() - started,
    }


def _one(config: Config, seed: int, text: str, out: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    record = run_config(config, seed, text)
    atomic_write_json(record_path(out, config.name, seed), record)
    return record


def testbed_runs(names: Sequence[str] | None = None, shard: tuple[int, int] = (0, 1),
                 ) -> list[tuple[str, int]]:
    """``(configuration, seed)`` of the runs of ``names`` (default: the whole :data:`TESTBED`),
    seed 0 of every configuration first, then every ``shard[1]``-th of them from the
    ``shard[0]``-th.  Raises :class:`UsageError` for an unknown configuration."""
    names = list(names or TESTBED)
    unknown = [n for n in names if n not in TESTBED]
    if unknown:
        raise UsageError(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(TESTBED)}")
    every = sorted(((n, s) for n in names for s in TESTBED[n].seeds), key=lambda r: r[1])
    return every[shard[0]::shard[1]]


def run_testbed(
    text: str, out: Path = DEFAULT_OUT, *, names: Sequence[str] | None = None, jobs: int = 1,
    force: bool = False, shard: tuple[int, int] = (0, 1), echo: Callable[[str], None] = print,
) -> list[Path]:
    """Run the missing runs of ``names`` (default: the whole :data:`TESTBED`), seed 0
    of every configuration first; ``shard=(i, n)`` keeps every n-th of those runs from the
    i-th, so n processes or machines share the testbed.  Returns the records' paths of this
    shard's runs (finished before or now)."""
    if jobs < 1:
        raise UsageError(f"--jobs must be a positive integer, got {jobs}")
    runs = testbed_runs(names, shard)
    fingerprint = data_fingerprint(text)
    todo = []
    for name, seed in runs:
        path = record_path(out, name, seed)
        if path.is_file() and not force:
            if read_json(path, "a stability record").get("data") != fingerprint:
                raise UsageError(f"{str(path)!r} was trained on other data: pass another --out")
            echo(f"{name} seed={seed}: finished before, skipped")
            continue
        todo.append((name, seed))
    echo(f"research.stability: {len(todo)} run(s) to train of {len(runs)} in this invocation, out {out}")
    failures = []

    def done(name: str, seed: int, finish: Callable[[], dict]) -> None:
        try:
            record = finish()
        except Exception as err:  # noqa: BLE001 - the other runs go on; said at the end
            failures.append(f"{name} seed={seed}: {type(err).__name__}: {err}")
            return
        echo(f"{name} seed={seed}: {record['steps']} steps, final val loss "
             f"{record['final_val_loss']:.4f}, {record['cpu_seconds']:.0f} CPU s")

    if jobs == 1:
        for name, seed in todo:
            done(name, seed, lambda n=name, s=seed: _one(TESTBED[n], s, text, Path(out)))
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo) or 1), mp_context=context) as pool:
            futures = {pool.submit(_one, TESTBED[n], s, text, Path(out)): (n, s) for n, s in todo}
            for future in as_completed(futures):
                done(*futures[future], future.result)
    if failures:
        raise RuntimeError("research.stability: runs failed: " + "; ".join(failures))
    return [record_path(out, n, s) for n, s in runs]
