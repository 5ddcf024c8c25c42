"""The eps comparison: train the tiny recipe at several eps and seeds, measure each.

For every (eps, seed) pair the recipe is trained with the monitors, TensorBoard logs in
``<out>/eps=<eps>/seed=<seed>/``, then the finished model is measured on the fixed
held-out windows (:func:`lnmonitor.experiments.measure.measure`, the pipeline
``lnmonitor analyze`` runs too) and a run record ``result.json`` is written there
atomically. The merged ``<out>/results.json``, ``report.md`` and the figures are
rebuilt from the records after every run (:func:`lnmonitor.experiments.report.publish`).
This module imports torch only inside the functions that train or measure, so the
command line can show its help and check its input without it.

Reliability:

* a record's presence means the run finished: it is never retrained (``force`` redoes it);
* an interrupted run resumes from its ``last.ckpt`` (saved every ``val_every`` steps);
* ``shard=(i, n)`` runs only the pairs whose index in the grid is ``i`` modulo ``n``, so
  several processes sharing a file system split the work; each writes only its own
  records, and whichever publishes last merges everything present;
* ``jobs=n`` runs n fits side by side in worker processes, the torch threads split
  between them;
* the grid of an output folder grows: a later invocation with other eps or seeds adds
  its pairs to the ones asked for before;
* everything that can be wrong with the input (eps, seeds, shard, a corrupt or foreign
  ``results.json``, record or checkpoint) raises :class:`UsageError` before anything is
  written.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lnmonitor.errors import UsageError
from lnmonitor.experiments.files import atomic_write_json
from lnmonitor.experiments.report import merge_results, publish, results_pairs
from lnmonitor.experiments.store import (
    RECORD_FORMAT,
    RECORD_NAME,
    RESULTS_NAME,
    check_config,
    eps_label,
    grid_pairs,
    load_results,
    run_dir,
    scan_records,
)
from lnmonitor.tiny.recipe import Recipe

DEFAULT_EPS = (1e-5, 1e-1)
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_OUT = Path("runs/eps-compare")
# Held-out windows (of the up to 512 fixed ones) the per-row norm statistics use (float64 on
# the CPU, the slow part); the loss uses every window, the invariance the probe rows.
NORM_WINDOWS = 256

# ---------------------------------------------------------------------------
# input
# ---------------------------------------------------------------------------


def parse_eps(values: Sequence) -> tuple[float, ...]:
    """Distinct finite eps > 0, in the order given; UsageError otherwise."""
    if not values:
        raise UsageError("--eps needs at least one value, e.g. --eps 1e-5 1e-1")
    out: list[float] = []
    for raw in values:
        try:
            eps = float(raw)
        except (TypeError, ValueError):
            raise UsageError(f"eps {raw!r} is not a number: pass values like 1e-5 0.1") from None
        if not (math.isfinite(eps) and eps > 0):
            raise UsageError(f"eps must be a finite number > 0, got {raw!r}")
        if eps in out:
            raise UsageError(f"eps {raw!r} is given twice (as {eps_label(eps)}): pass each value once")
        out.append(eps)
    return tuple(out)


def parse_seeds(values: Sequence) -> tuple[int, ...]:
    """Distinct integer seeds >= 0, in the order given; UsageError otherwise."""
    if not values:
        raise UsageError("--seeds needs at least one seed, e.g. --seeds 0 1 2")
    out: list[int] = []
    for raw in values:
        try:
            seed = int(str(raw), 10)
        except ValueError:
            raise UsageError(f"seed {raw!r} is not an integer: pass values like 0 1 2") from None
        if seed < 0:
            raise UsageError(f"seeds must be integers >= 0, got {raw!r}")
        if seed in out:
            raise UsageError(f"seed {raw!r} is given twice: pass each seed once")
        out.append(seed)
    return tuple(out)


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) as ``(i, n)``; None is ``(0, 1)``, the whole grid."""
    if text is None:
        return (0, 1)
    parts = str(text).split("/")
    try:
        if len(parts) != 2:
            raise ValueError
        index, count = int(parts[0], 10), int(parts[1], 10)
    except ValueError:
        raise UsageError(f"--shard must look like i/n (e.g. 0/3), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"--shard i/n needs n >= 1 and 0 <= i < n (i counts from 0), got {text!r}")
    return (index, count)


def data_fingerprint(text: str) -> dict:
    return {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "chars": len(text)}


def experiment_config(recipe: Recipe, text: str) -> dict:
    """What must match for runs to be compared: the recipe without eps and seed, the
    numerical precision and the data. Left out on purpose: accelerator and devices, so
    shards may run on different machines, and ``val_every``, which sets only how often the
    curve is sampled and the checkpoint saved (training does not depend on it)."""
    fields = recipe.to_dict()
    for name in ("eps", "seed", "val_every"):
        fields.pop(name)
    return {
        "recipe": fields,
        "precision": str(recipe.trainer_kwargs.get("precision") or "32-true"),
        "data": data_fingerprint(text),
    }


@dataclass(frozen=True)
class Experiment:
    """A grid of eps x seeds over one base recipe (its own eps and seed are ignored)."""

    recipe: Recipe
    eps: tuple[float, ...] = DEFAULT_EPS
    seeds: tuple[int, ...] = DEFAULT_SEEDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", parse_eps(self.eps))
        object.__setattr__(self, "seeds", parse_seeds(self.seeds))

    def pairs(self) -> list[tuple[float, int]]:
        return grid_pairs(self.eps, self.seeds)

    def shard(self, index: int, count: int) -> list[tuple[float, int]]:
        return [p for i, p in enumerate(self.pairs()) if i % count == index]

    def recipe_for(self, eps: float, seed: int) -> Recipe:
        return replace(self.recipe, eps=float(eps), seed=int(seed))


# ---------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------


def _check_checkpoint(state: dict | None, recipe: Recipe, vocab: str, path: Path) -> None:
    if not state or "corrupt" in state:
        return
    expected = recipe.module_kwargs(vocab)
    found = {k: state["hparams"].get(k) for k in expected}
    if found != expected:
        diffs = [f"{k}={found[k]!r} there, {expected[k]!r} now" for k in expected if found[k] != expected[k]]
        raise UsageError(
            f"checkpoint {str(path)!r} is from a different configuration ({'; '.join(diffs[:3])}): "
            "use the same options, or pass another --out"
        )
    if state["step"] > recipe.max_steps:
        raise UsageError(
            f"checkpoint {str(path)!r} is at step {state['step']}, past --max-steps {recipe.max_steps}: "
            "use the same options, or pass another --out"
        )


# ---------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------


def measure(module, batches) -> dict:
    """Everything a run record holds about a trained model, on the held-out ``batches``:
    :func:`lnmonitor.experiments.measure.measure` over the first :data:`NORM_WINDOWS`
    windows for the norm statistics, as plain JSON-ready numbers."""
    import numpy as np

    from lnmonitor import geometry
    from lnmonitor.experiments.measure import measure as measure_held_out
    from lnmonitor.ladder import baseline_median

    m = measure_held_out(module, batches, norm_batches=max(NORM_WINDOWS // batches[0][0].shape[0], 1))
    shares = {s.name: s for s in m.shares}
    norms = {}
    for r, step in zip(m.rows, m.ladder, strict=True):
        s = shares[r.name]
        norms[r.name] = {
            "kind": r.kind, "width": r.width, "eps": r.eps,
            "sigma": step.sigma, "inv_sigma": step.inv_sigma, "rms": step.rms,
            "eps_over_var": step.eps_over_var, "transmission": step.transmission,
            "share_median": s.median, "share_p90": s.p90, "share_max": s.max,
            "share_rows": s.rows, "share_skipped": s.skipped,
            "share_baseline_median": s.baseline_median, "share_baseline_max": s.baseline_max,
        }
    order = [r.name for r in m.rows]
    first = m.rows[0]
    k = geometry.dead_dim(first.kind)
    baseline = {"d": first.width, "k": k, "median": baseline_median(first.width, k)}
    inv = m.invariance
    sweep = [asdict(p) for p in inv.sweep]
    at = {p["scale"]: p for p in sweep}
    first, final = norms[order[0]], norms[order[-1]]
    headline = {
        "val_loss": m.val_loss,
        "scale_slope": inv.slope,
        "scale_constant": inv.constant,
        "dloss_scale_3": inv.cases["scale_3"].dloss,  # signed
        "dloss_scale_0.01": at[0.01]["dloss"] if 0.01 in at else math.nan,
        "out_residual_scale_3": inv.cases["scale_3"].out_residual,
        "final_eps_over_var": final["eps_over_var"],
        "first_transmission": first["transmission"],
        "final_transmission": final["transmission"],
        "max_transmission": max(n["transmission"] for n in norms.values()),
        "attenuation": m.attenuation,
        "growth": m.growth,
        "final_share_median": final["share_median"],
        "mean_share_median": float(np.mean([n["share_median"] for n in norms.values()])),
    }
    return {
        "headline": headline,
        "norms": norms,
        "norm_order": order,
        "ladder": {"attenuation": m.attenuation, "growth": m.growth},
        "share_baseline": baseline,
        "windows": m.windows,
        "invariance": {
            "final_norm": inv.final_norm, "rows": inv.rows, "base_loss": inv.base_loss,
            "slope": inv.slope, "constant": inv.constant, "fit_note": inv.fit_note,
            "cases": {name: asdict(c) for name, c in inv.cases.items()},
            "sweep": sweep,
            "rounding_scales": inv.rounding_scales,
        },
    }


# ---------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------

HPARAM_FIELDS = ("eps", "seed", "norm", "init", "decay", "width", "depth", "heads", "context", "max_steps",
                 "batch_size", "lr", "weight_decay", "grad_clip")
FINAL_PREFIX = "final"
# Headline figures of a run record, logged as ``final/<key>`` scalars at the last step.
FINAL_METRICS = (
    "val_loss", "scale_slope", "scale_constant", "dloss_scale_3", "dloss_scale_0.01", "out_residual_scale_3",
    "final_eps_over_var", "first_transmission", "final_transmission", "max_transmission", "attenuation",
    "growth", "final_share_median", "mean_share_median",
)


def write_hparams_session(logger, recipe: Recipe, monitor: bool) -> None:
    """Open the run's HPARAMS-tab session: eps, seed and the recipe, with the ``final/...``
    figures (and the validation loss curve) as its metric columns.

    TensorBoard keeps the first hparams session of a run, so this is written before the fit
    starts (the monitors' own session, written at their setup, then comes second). The
    metric values are the scalars logged under those names: :func:`log_final` writes them
    once the run is measured. eps, seed, norm, init and decay are the columns in view.
    """
    from lnmonitor.hparams_session import session_summaries

    params = {k: getattr(recipe, k) for k in HPARAM_FIELDS}
    params["monitors"] = bool(monitor)
    names = [f"{FINAL_PREFIX}/{k}" for k in FINAL_METRICS] + ["val/loss"]
    writer = logger.experiment._get_file_writer()
    for summary in session_summaries(params, names):
        writer.add_summary(summary)
    writer.flush()


def log_final(logger, record: dict) -> None:
    """The run's headline figures as ``final/<key>`` scalars at its last step."""
    metrics = {
        f"{FINAL_PREFIX}/{k}": float(v) for k, v in record["headline"].items()
        if v is not None and math.isfinite(v)
    }
    logger.log_metrics(metrics, step=record["steps"])
    logger.finalize("success")


class RunInterrupted(RuntimeError):
    """The fit stopped before ``max_steps`` (its checkpoint is kept for the next attempt)."""


def run_one(
    experiment: Experiment, eps: float, seed: int, out: Path, text: str, *,
    monitor: bool = True, callbacks: Sequence = (), progress: bool = True,
    echo: Callable[[str], None] = print, tag: str = "", data_name: str | None = None,
) -> dict:
    """Train (or resume) and measure one (eps, seed) run and write its record."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lnmonitor.tiny.checkpoint import checkpoint_state, load_checkpoint
    from lnmonitor.tiny.data import CharDataModule
    from lnmonitor.tiny.train import fit, monitor_callbacks

    recipe = experiment.recipe_for(eps, seed)
    folder = run_dir(out, eps, seed)
    name = f"eps={eps_label(eps)} seed={seed}"
    last = folder / "checkpoints" / "last.ckpt"
    state = checkpoint_state(last)
    if state and "corrupt" in state:
        aside = last.with_name(f"last.corrupt-{int(time.time())}.ckpt")
        last.replace(aside)
        echo(f"{tag}{name}: checkpoint unreadable ({state['corrupt']}); moved to {aside.name}, starting over")
        state = None
    if state:
        echo(f"{tag}{name}: resuming from step {state['step']} of {recipe.max_steps}")
    else:
        echo(f"{tag}{name}: starting ({recipe.max_steps} steps)")

    logger = TensorBoardLogger(
        save_dir=str(out), name=f"eps={eps_label(eps)}", version=f"seed={seed}", default_hp_metric=False
    )
    write_hparams_session(logger, recipe, monitor)
    extra = [*(monitor_callbacks() if monitor else []), *callbacks]
    started = time.perf_counter()
    result = fit(recipe, text, folder, logger=logger, callbacks=extra, progress=progress)
    train_seconds = time.perf_counter() - started
    if result.steps < recipe.max_steps:
        raise RunInterrupted(
            f"{name} stopped at step {result.steps} of {recipe.max_steps}; run again to resume"
        )

    started = time.perf_counter()
    module, _ = load_checkpoint(result.checkpoint)
    batches = CharDataModule(text, vocab=module.vocab, context=recipe.context,
                             batch_size=recipe.batch_size).val_batches()
    measured = measure(module, batches)
    measure_seconds = time.perf_counter() - started
    import torch

    from lnmonitor.experiments.events import read_scalars

    record = {
        "format": RECORD_FORMAT,
        "config": experiment_config(experiment.recipe, text),
        "eps": float(eps),
        "seed": int(seed),
        "steps": int(result.steps),
        "resumed_from_step": state["step"] if state else None,
        "val_loss": measured["headline"]["val_loss"],
        "fit_val_loss": result.val_loss,
        "train_seconds": train_seconds,
        "measure_seconds": measure_seconds,
        "monitors": bool(monitor),
        "data_name": data_name,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "threads": torch.get_num_threads(),
        "versions": _versions(),
        **measured,
        "curves": {tag: [[step, float(f"{value:.6g}")] for step, value in points]
                   for tag, points in read_scalars(folder, _is_curve).items()},
    }
    log_final(logger, record)
    atomic_write_json(folder / RECORD_NAME, record)
    echo(
        f"{tag}{name}: done, val loss {record['val_loss']:.4f} nats/char, "
        f"{train_seconds:.1f} s training + {measure_seconds:.1f} s measuring"
    )
    return record


# What a record keeps of the training logs: the losses and, per norm, what the ladder and
# the eps question read (a report then needs no event file).
CURVES = ("val/loss", "train/loss", "lnmonitor/ladder/")
NORM_CURVES = ("eps_over_var", "transmission", "inv_sigma", "rms")


def _is_curve(tag: str) -> bool:
    return tag.startswith(CURVES) or any(tag.startswith(f"lnmonitor/{q}/") for q in NORM_CURVES)


def remeasure_run(out: Path, eps: float, seed: int, text: str, record: dict,
                  echo: Callable[[str], None] = print, tag: str = "") -> dict:
    """Measure a finished run again from its checkpoint with this lnmonitor's measurement
    (:func:`measure`) and rewrite its record: the training part (steps, curves, timings,
    the fit's own loss) stays, the measurement is replaced."""
    from lnmonitor.tiny.checkpoint import load_checkpoint
    from lnmonitor.tiny.data import CharDataModule

    folder = run_dir(out, eps, seed)
    last = folder / "checkpoints" / "last.ckpt"
    if not last.is_file():
        raise UsageError(f"{str(last)!r} is missing: the run's record can be kept, not measured again")
    started = time.perf_counter()
    module, _ = load_checkpoint(last)
    batches = CharDataModule(text, vocab=module.vocab, context=module.config.context,
                             batch_size=record["config"]["recipe"]["batch_size"]).val_batches()
    measured = measure(module, batches)
    updated = {**record, **measured, "val_loss": measured["headline"]["val_loss"],
               "measure_seconds": time.perf_counter() - started, "versions": _versions(),
               "remeasured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_json(folder / RECORD_NAME, updated)
    echo(f"{tag}eps={eps_label(eps)} seed={seed}: measured again, val loss {updated['val_loss']:.4f} "
         f"nats/char ({updated['measure_seconds']:.1f} s)")
    return updated


def _versions() -> dict:
    import lightning
    import torch

    import lnmonitor

    return {
        "lnmonitor": lnmonitor.__version__, "torch": torch.__version__,
        "lightning": lightning.__version__, "python": sys.version.split()[0],
    }


# ---------------------------------------------------------------------------
# the whole grid
# ---------------------------------------------------------------------------


def _discard(folder: Path) -> None:
    """Remove a run folder for --force: renamed away first (atomic), so a kill mid-delete
    never leaves a half-deleted run folder that a later attempt would append to."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{time.time_ns()}")
    folder.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def check_out(out: Path, config: dict) -> dict:
    """Refuse an ``out`` whose results or records come from another configuration (or are
    corrupt); returns the records already there. Writes nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    existing = load_results(out)
    if existing is not None:
        check_config(existing["config"], config, out / RESULTS_NAME)
    return scan_records(out, config)


def run_experiment(
    experiment: Experiment, text: str, out: Path, *, shard: tuple[int, int] = (0, 1),
    force: bool = False, monitor: bool = True, callbacks: Sequence = (), progress: bool = True,
    echo: Callable[[str], None] = print, data_name: str | None = None, jobs: int = 1,
    remeasure: bool = False,
) -> dict:
    """Run this shard's pairs of the grid (skipping finished ones) and publish the results.

    The grid of ``out`` grows: it is every pair asked for there so far, so a dose-response
    can be added to a two-eps comparison later.  ``jobs`` runs that many fits side by side
    in their own processes, the torch threads split between them (``callbacks`` need
    ``jobs=1``).  ``remeasure`` trains nothing: it measures this shard's finished runs
    again from their checkpoints (:func:`remeasure_run`).  Returns the merged results (the
    content of ``results.json``); raises :class:`RunInterrupted` after the others finished
    when a run did not reach its last step.
    """
    import torch

    if jobs > 1 and callbacks:
        raise ValueError("extra callbacks cannot travel to worker processes: use jobs=1")
    out = Path(out)
    config = experiment_config(experiment.recipe, text)
    records = check_out(out, config)
    existing = load_results(out)
    asked = results_pairs(existing) if existing is not None else []
    pairs = asked + [p for p in experiment.pairs() if p not in asked]
    mine = experiment.shard(*shard)
    from lnmonitor.tiny.checkpoint import checkpoint_state
    from lnmonitor.tiny.data import CharVocab

    vocab = CharVocab.from_text(text).chars
    for eps, seed in mine:
        if force or (eps, seed) in records:
            continue
        last = run_dir(out, eps, seed) / "checkpoints" / "last.ckpt"
        _check_checkpoint(checkpoint_state(last), experiment.recipe_for(eps, seed), vocab, last)

    out.mkdir(parents=True, exist_ok=True)
    publish(out, config, pairs)  # results.json now guards --out
    for eps, seed in mine:  # what a --force killed while deleting left behind
        for trash in run_dir(out, eps, seed).parent.glob(f".trash-seed={seed}-*"):
            shutil.rmtree(trash, ignore_errors=True)
    total = len(mine)
    where = f" (shard {shard[0]}/{shard[1]})" if shard[1] > 1 else ""
    echo(f"eps-compare: {total} of {len(pairs)} runs in this invocation{where}, out {out}")
    if remeasure:
        for i, (eps, seed) in enumerate(mine, start=1):
            if (eps, seed) in records:
                remeasure_run(out, eps, seed, text, records[(eps, seed)], echo, f"[{i}/{total}] ")
            else:
                echo(f"[{i}/{total}] eps={eps_label(eps)} seed={seed}: not finished, nothing to measure")
        return publish(out, config, pairs)
    todo = []
    for i, (eps, seed) in enumerate(mine, start=1):
        tag = f"[{i}/{total}] "
        folder = run_dir(out, eps, seed)
        if force and folder.exists():
            (folder / RECORD_NAME).unlink(missing_ok=True)  # first: an unfinished run has no record
            _discard(folder)
        elif (eps, seed) in records:
            record = records[(eps, seed)]
            echo(f"{tag}eps={eps_label(eps)} seed={seed}: skipped, finished before "
                 f"(val loss {record['val_loss']:.4f} nats/char)")
            continue
        todo.append((eps, seed, tag))
    failures: list[str] = []
    jobs = max(1, min(jobs, len(todo)))
    if jobs == 1:
        for eps, seed, tag in todo:
            try:
                run_one(experiment, eps, seed, out, text, monitor=monitor, callbacks=callbacks,
                        progress=progress, echo=echo, tag=tag, data_name=data_name)
            except RunInterrupted as err:
                failures.append(str(err))
            publish(out, config, pairs)
    else:
        threads = max(1, torch.get_num_threads() // jobs)
        echo(f"eps-compare: {jobs} runs side by side, {threads} torch thread(s) each")
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = {
                pool.submit(_run_in_worker, threads, experiment, eps, seed, out, text, monitor, tag,
                            data_name): (eps, seed)
                for eps, seed, tag in todo
            }
            for future in as_completed(futures):
                eps, seed = futures[future]
                try:
                    future.result()
                except Exception as err:  # noqa: BLE001 - the other runs go on; said at the end
                    failures.append(f"eps={eps_label(eps)} seed={seed}: {type(err).__name__}: {err}")
                publish(out, config, pairs)
    results = publish(out, config, pairs)
    if results["missing"]:
        shown = ", ".join(f"eps={eps_label(m['eps'])} seed={m['seed']}" for m in results["missing"])
        echo(f"eps-compare: still missing (another shard, or not finished): {shown}")
    for diff in results["differences"].values():
        echo(f"eps-compare: {diff['verdict']}")
    echo(f"eps-compare: report {out / 'report.md'}; TensorBoard: tensorboard --logdir {out}")
    if failures:
        raise RunInterrupted("; ".join(failures))
    return results


def _run_in_worker(threads: int, experiment: Experiment, eps: float, seed: int, out: Path, text: str,
                   monitor: bool, tag: str, data_name: str | None) -> None:
    """One run in a worker process of ``run_experiment(jobs > 1)``: its share of the threads,
    no progress bar (lines from several fits would interleave)."""
    import torch

    torch.set_num_threads(threads)
    run_one(experiment, eps, seed, out, text, monitor=monitor, progress=False,
            echo=lambda line: print(line, flush=True), tag=tag, data_name=data_name)


__all__ = [
    "DEFAULT_EPS",
    "DEFAULT_OUT",
    "DEFAULT_SEEDS",
    "Experiment",
    "RunInterrupted",
    "data_fingerprint",
    "experiment_config",
    "measure",
    "merge_results",
    "parse_eps",
    "parse_seeds",
    "parse_shard",
    "remeasure_run",
    "run_experiment",
    "run_one",
]
