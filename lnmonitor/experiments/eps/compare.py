"""The eps comparison: train the tiny recipe at every (eps, seed) of a grid, measure each run and publish
the merged results (:func:`run_experiment`).  Imports torch only inside the functions that train or measure.

Finished runs (those with a record) are skipped, interrupted ones resume from ``last.ckpt``; ``shard=(i, n)``
runs the pairs whose grid index is i modulo n, and whichever shard publishes last merges every record; the
grid of an output folder grows with each invocation; bad input raises UsageError before anything is written.
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
from lnmonitor.experiments.eps.store import (
    RECORD_NAME,
    RESULTS_NAME,
    check_config,
    eps_label,
    load_results,
    run_dir,
    scan_records,
)

__all__ = ["DEFAULT_OUT", "check_out", "run_experiment"]

DEFAULT_OUT = Path("runs/eps-compare")


def _discard(folder: Path) -> None:
    """Remove a run folder for --force, renamed away first so a kill mid-delete leaves no half run."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{time.time_ns()}")
    folder.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def check_out(out: Path, config: dict) -> dict:
    """Refuse an ``out`` whose results or records are corrupt or another configuration's; returns the
    records already there. Writes nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    existing = load_results(out)
    if existing is not None:
        check_config(existing["config"], config, out / RESULTS_NAME)
    return scan_records(out, config)


def run_experiment(
    experiment: Experiment, text: str, out: Path, *, shard: tuple[int, int] = (0, 1), force: bool = False,
    monitor: bool = True, callbacks: Sequence = (), progress: bool = True, jobs: int = 1,
    echo: Callable[[str], None] = print, data_name: str | None = None, remeasure: bool = False,
) -> dict:
    """Run this shard's unfinished pairs of the grid (every pair asked for in ``out`` so far) and publish.

    ``jobs`` fits run side by side in worker processes, the torch threads split between them (``callbacks``
    need ``jobs=1``); ``remeasure`` trains nothing and measures the finished runs again. Returns the merged
    results (``results.json``); raises :class:`RunInterrupted`, after the other runs, when one stopped early.
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
    """Refuse, before anything is written, a checkpoint to resume from that is another recipe's."""
    from lnmonitor.tiny.checkpoint import checkpoint_state
    from lnmonitor.tiny.data import CharVocab

    vocab = CharVocab.from_text(text).chars
    for eps, seed in pairs:
        last = run_dir(out, eps, seed) / "checkpoints" / "last.ckpt"
        check_checkpoint(checkpoint_state(last), experiment.recipe_for(eps, seed), vocab, last)


def _to_run(out: Path, mine: Sequence, records: dict, force: bool,
            echo: Callable[[str], None]) -> list[tuple[float, int, str]]:
    """``(eps, seed, tag)`` of the runs to train: finished ones skipped, or with ``force`` discarded."""
    todo = []
    for i, (eps, seed) in enumerate(mine, start=1):
        tag = f"[{i}/{len(mine)}] "
        folder = run_dir(out, eps, seed)
        if force and folder.exists():
            (folder / RECORD_NAME).unlink(missing_ok=True)  # first: an unfinished run has no record
            _discard(folder)
        elif (eps, seed) in records:
            echo(f"{tag}eps={eps_label(eps)} seed={seed}: skipped, finished before "
                 f"(val loss {records[(eps, seed)]['val_loss']:.4f} nats/char)")
            continue
        todo.append((eps, seed, tag))
    return todo


def _side_by_side(jobs: int, todo: Sequence, published: Callable[[], dict], echo: Callable[[str], None],
                  experiment: Experiment, out: Path, text: str, monitor: bool,
                  data_name: str | None) -> list[str]:
    """Run ``todo`` in ``jobs`` worker processes, calling ``published()`` after each; returns the failures."""
    import torch

    failures: list[str] = []
    threads = max(1, torch.get_num_threads() // jobs)
    echo(f"eps-compare: {jobs} runs side by side, {threads} torch thread(s) each")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_in_worker, threads, experiment, eps, seed, out, text, monitor, tag,
                               data_name): (eps, seed) for eps, seed, tag in todo}
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
    """One run in a worker process: its share of the threads, no progress bar (fits would interleave)."""
    import torch

    torch.set_num_threads(threads)
    run_one(experiment, eps, seed, out, text, monitor=monitor, progress=False,
            echo=lambda line: print(line, flush=True), tag=tag, data_name=data_name)
