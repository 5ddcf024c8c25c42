"""The eps comparison: train the tiny recipe at several eps and seeds, measure each.

For every (eps, seed) pair the recipe is trained with the monitors, TensorBoard logs in
``<out>/eps=<eps>/seed=<seed>/``, then the finished model is measured on the fixed
held-out windows (:func:`lnmonitor.experiments.measure.held_out_measurement`, the pipeline
``lnmonitor analyze`` runs too) and a run record ``result.json`` is written there
atomically. The merged ``<out>/results.json``, ``report.md`` and the figures are
rebuilt from the records after every run (:func:`lnmonitor.experiments.eps.report.publish`).
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

import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps.grid import Experiment, experiment_config
from lnmonitor.experiments.eps.report import publish, results_pairs
from lnmonitor.experiments.eps.run import RunInterrupted, check_checkpoint, remeasure_run, run_one

__all__ = ["DEFAULT_OUT", "check_out", "run_experiment"]
from lnmonitor.experiments.eps.store import (
    RECORD_NAME,
    RESULTS_NAME,
    check_config,
    eps_label,
    load_results,
    run_dir,
    scan_records,
)

DEFAULT_OUT = Path("runs/eps-compare")

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
    if jobs > 1 and callbacks:
        raise ValueError("extra callbacks cannot travel to worker processes: use jobs=1")
    out = Path(out)
    config = experiment_config(experiment.recipe, text)
    records = check_out(out, config)
    existing = load_results(out)
    asked = results_pairs(existing) if existing is not None else []
    pairs = asked + [p for p in experiment.pairs() if p not in asked]
    mine = experiment.shard(*shard)
    _check_checkpoints(experiment, text, out, [p for p in mine if not (force or p in records)])

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
    todo = _to_run(out, mine, records, force, echo)
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
        failures = _side_by_side(jobs, todo, lambda: publish(out, config, pairs), echo, experiment, out, text,
                                 monitor, data_name)
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


def _check_checkpoints(experiment: Experiment, text: str, out: Path, pairs: Sequence) -> None:
    """Refuse before anything is written when a checkpoint to resume from is another recipe's."""
    from lnmonitor.tiny.checkpoint import checkpoint_state
    from lnmonitor.tiny.data import CharVocab

    vocab = CharVocab.from_text(text).chars
    for eps, seed in pairs:
        last = run_dir(out, eps, seed) / "checkpoints" / "last.ckpt"
        check_checkpoint(checkpoint_state(last), experiment.recipe_for(eps, seed), vocab, last)


def _to_run(out: Path, mine: Sequence, records: dict, force: bool,
            echo: Callable[[str], None]) -> list[tuple[float, int, str]]:
    """``(eps, seed, tag)`` of this shard's runs to train: the finished ones are skipped (said),
    or with ``force`` discarded and trained again."""
    todo = []
    for i, (eps, seed) in enumerate(mine, start=1):
        tag = f"[{i}/{len(mine)}] "
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
    return todo


def _side_by_side(jobs: int, todo: Sequence, published: Callable[[], dict], echo: Callable[[str], None],
                  experiment: Experiment, out: Path, text: str, monitor: bool,
                  data_name: str | None) -> list[str]:
    """Run ``todo`` in ``jobs`` worker processes, the torch threads split between them, calling
    ``published()`` after each; returns what failed, one line each (the others go on)."""
    import torch

    failures: list[str] = []
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
            published()
    return failures


def _run_in_worker(threads: int, experiment: Experiment, eps: float, seed: int, out: Path, text: str,
                   monitor: bool, tag: str, data_name: str | None) -> None:
    """One run in a worker process of ``run_experiment(jobs > 1)``: its share of the threads,
    no progress bar (lines from several fits would interleave)."""
    import torch

    torch.set_num_threads(threads)
    run_one(experiment, eps, seed, out, text, monitor=monitor, progress=False,
            echo=lambda line: print(line, flush=True), tag=tag, data_name=data_name)

