"""One run of the eps comparison: train (or resume) the recipe at one (eps, seed), measure the finished
model on the held-out text and write its record ``result.json``; or measure a finished run again.
torch is imported only inside the functions that train or measure."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from lnmonitor.core.output.files import atomic_write_json
from lnmonitor.core.output.metric_names import TRAIN_LOSS, VAL_LOSS, final_metric, parse
from lnmonitor.errors import UsageError
from lnmonitor.experiments.eps.grid import Experiment, experiment_config
from lnmonitor.experiments.eps.store import RECORD_FORMAT, RECORD_NAME, eps_label, run_dir
from lnmonitor.tiny.recipe import Recipe

__all__ = [
    "FINAL_METRICS", "HPARAM_FIELDS", "NORM_WINDOWS", "RunInterrupted", "check_checkpoint", "log_final",
    "record_measurement", "remeasure_run", "remeasured", "run_one", "write_hparams_session",
]

# Held-out windows (of the up to 512) the per-row norm statistics use: float64 on the CPU, the slow part.
NORM_WINDOWS = 256
HPARAM_FIELDS = ("eps", "seed", "norm", "init", "decay", "width", "depth", "heads", "context", "max_steps",
                 "batch_size", "lr", "weight_decay", "grad_clip")
# Headline figures of a run record, logged as ``final/<key>`` scalars at the last step.
FINAL_METRICS = (
    "val_loss", "scale_slope", "scale_constant", "dloss_scale_3", "dloss_scale_0.01", "out_residual_scale_3",
    "final_eps_over_var", "first_transmission", "final_transmission", "max_transmission", "attenuation",
    "growth", "final_share_median", "mean_share_median",
)
# what a record keeps of the training logs: the losses and, per norm, what the ladder and eps question read
CURVES = (VAL_LOSS, TRAIN_LOSS)
NORM_CURVES = ("eps_over_var", "transmission", "inv_sigma", "rms")
# what a record of format /1 held of its measurement, which a /2 measurement replaces
OLD_MEASUREMENT = ("norms", "ladder", "share_baseline")


def check_checkpoint(state: dict | None, recipe: Recipe, vocab: str, path: Path) -> None:
    """UsageError when the checkpoint ``state`` is another recipe's or past ``max_steps``."""
    if not state or "corrupt" in state:
        return
    expected = recipe.module_kwargs(vocab)
    found = {k: state["hparams"].get(k) for k in expected}
    if found != expected:
        diffs = [f"{k}={found[k]!r} there, {expected[k]!r} now" for k in expected if found[k] != expected[k]]
        raise UsageError(f"checkpoint {str(path)!r} is from a different configuration "
                         f"({'; '.join(diffs[:3])}): use the same options, or pass another --out")
    if state["step"] > recipe.max_steps:
        raise UsageError(f"checkpoint {str(path)!r} is at step {state['step']}, past --max-steps "
                         f"{recipe.max_steps}: use the same options, or pass another --out")


def record_measurement(module, batches) -> dict:
    """What a run record holds about a trained model, measured on the held-out ``batches`` (the norm
    statistics on the first :data:`NORM_WINDOWS` windows): the headline, the meter's ``metrics`` under the
    names a monitor logs them, which norm is which (``norm_info``, ``rungs``, ``final_norm``) and the
    invariance probe."""
    from lnmonitor.core.maths import geometry
    from lnmonitor.experiments.measure import held_out_measurement

    m = held_out_measurement(module, batches, norm_batches=max(NORM_WINDOWS // batches[0][0].shape[0], 1))
    figures = m.result.figures
    inv = m.invariance
    return {
        "headline": _headline(m),
        "metrics": m.result.metrics(positions=True),
        "norm_order": m.order,
        "norm_info": {info.name: {"kind": info.kind, "width": info.width, "eps": f.eps,
                                  "role": info.role, "dead_dim": geometry.dead_dim(info.kind)}
                      for info, f in zip(m.result.norms, figures.norms, strict=True)},
        "rungs": figures.rungs,
        "final_norm": figures.final,
        "windows": m.windows,
        "invariance": {
            "final_norm": inv.final_norm, "rows": inv.rows, "base_loss": inv.base_loss,
            "slope": inv.slope, "constant": inv.constant, "fit_note": inv.fit_note,
            "cases": {name: asdict(c) for name, c in inv.cases.items()},
            "sweep": [asdict(p) for p in inv.sweep],
            "rounding_scales": inv.rounding_scales,
        },
    }


def _headline(m) -> dict:
    """The run's headline figures (:data:`FINAL_METRICS`) from the meter's result and the invariance probe."""
    import numpy as np

    figures, inv = m.result.figures, m.invariance
    by_name = figures.by_name()
    first = by_name[figures.rungs[0]] if figures.rungs else None
    final = by_name.get(figures.final or (figures.rungs[-1] if figures.rungs else ""))
    shares = [f.stats.share_median for f in figures.norms if f.stats.share_rows]
    at = {p.scale: p for p in inv.sweep}
    return {
        "val_loss": m.val_loss, "scale_slope": inv.slope, "scale_constant": inv.constant,
        "dloss_scale_3": inv.cases["scale_3"].dloss,  # signed
        "dloss_scale_0.01": at[0.01].dloss if 0.01 in at else math.nan,
        "out_residual_scale_3": inv.cases["scale_3"].out_residual,
        "final_eps_over_var": final.eps_over_var if final else math.nan,
        "first_transmission": first.transmission if first else math.nan,
        "final_transmission": final.transmission if final else math.nan,
        "max_transmission": float(np.nanmax([f.transmission for f in figures.norms])),
        "attenuation": figures.attenuation, "growth": figures.growth,
        "final_share_median": final.stats.share_median if final else math.nan,
        "mean_share_median": float(np.mean(shares)) if shares else math.nan,
    }


def write_hparams_session(logger, recipe: Recipe, monitor: bool) -> None:
    """Open the run's HPARAMS-tab session: eps, seed and the recipe, with the ``final/...`` figures (written
    later by :func:`log_final`) and the validation loss as its metric columns.  TensorBoard keeps a run's
    first session, so this is written before the fit starts."""
    from lnmonitor.views.hparams_session import session_protos

    params = {k: getattr(recipe, k) for k in HPARAM_FIELDS}
    params["monitors"] = bool(monitor)
    names = [final_metric(k) for k in FINAL_METRICS] + [VAL_LOSS]
    writer = logger.experiment._get_file_writer()
    for proto in session_protos(params, names):
        writer.add_summary(proto)
    writer.flush()


def log_final(logger, record: dict) -> None:
    """The run's headline figures as ``final/<key>`` scalars at its last step."""
    metrics = {final_metric(k): float(v) for k, v in record["headline"].items()
               if v is not None and math.isfinite(v)}
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

    from lnmonitor.tiny.checkpoint import checkpoint_state
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

    logger = TensorBoardLogger(save_dir=str(out), name=f"eps={eps_label(eps)}", version=f"seed={seed}",
                               default_hp_metric=False)
    write_hparams_session(logger, recipe, monitor)
    extra = [*(monitor_callbacks() if monitor else []), *callbacks]
    started = time.perf_counter()
    result = fit(recipe, text, folder, logger=logger, callbacks=extra, progress=progress)
    train_seconds = time.perf_counter() - started
    if result.steps < recipe.max_steps:
        raise RunInterrupted(f"{name} stopped at step {result.steps} of {recipe.max_steps}; "
                             "run again to resume")

    measured, measure_seconds = _measure_checkpoint(result.checkpoint, text, recipe.batch_size)
    import torch

    from lnmonitor.views.events import read_scalars

    record = {
        "format": RECORD_FORMAT, "config": experiment_config(experiment.recipe, text),
        "eps": float(eps), "seed": int(seed), "steps": int(result.steps),
        "resumed_from_step": state["step"] if state else None,
        "val_loss": measured["headline"]["val_loss"], "fit_val_loss": result.val_loss,
        "train_seconds": train_seconds, "measure_seconds": measure_seconds,
        "monitors": bool(monitor), "data_name": data_name, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "threads": torch.get_num_threads(), "versions": _versions(),
        **measured,
        "curves": {tag: [[step, float(f"{value:.6g}")] for step, value in points]
                   for tag, points in read_scalars(folder, _is_curve).items()},
    }
    log_final(logger, record)
    atomic_write_json(folder / RECORD_NAME, record)
    echo(f"{tag}{name}: done, val loss {record['val_loss']:.4f} nats/char, "
         f"{train_seconds:.1f} s training + {measure_seconds:.1f} s measuring")
    return record


def _measure_checkpoint(path: Path, text: str, batch_size: int) -> tuple[dict, float]:
    """:func:`record_measurement` of the checkpoint at ``path`` on the held-out text, and its seconds."""
    from lnmonitor.tiny.checkpoint import load_checkpoint
    from lnmonitor.tiny.data import CharDataModule

    started = time.perf_counter()
    module, _ = load_checkpoint(path)
    batches = CharDataModule(text, vocab=module.vocab, context=module.config.context,
                             batch_size=batch_size).val_batches()
    return record_measurement(module, batches), time.perf_counter() - started


def _is_curve(tag: str) -> bool:
    metric = parse(tag)
    if metric is None:
        return tag.startswith(CURVES)
    return metric.group == "ladder" or (metric.group == "norm" and metric.statistic in NORM_CURVES)


def remeasure_run(out: Path, eps: float, seed: int, text: str, record: dict,
                  echo: Callable[[str], None] = print, tag: str = "") -> dict:
    """Measure a finished run again from its checkpoint and rewrite its record (:func:`remeasured`)."""
    folder = run_dir(out, eps, seed)
    last = folder / "checkpoints" / "last.ckpt"
    if not last.is_file():
        raise UsageError(f"{str(last)!r} is missing: the run's record can be kept, not measured again")
    measured, seconds = _measure_checkpoint(last, text, record["config"]["recipe"]["batch_size"])
    updated = {**remeasured(record, measured), "measure_seconds": seconds, "versions": _versions(),
               "remeasured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_json(folder / RECORD_NAME, updated)
    echo(f"{tag}eps={eps_label(eps)} seed={seed}: measured again, val loss {updated['val_loss']:.4f} "
         f"nats/char ({updated['measure_seconds']:.1f} s)")
    return updated


def remeasured(record: dict, measured: dict) -> dict:
    """``record`` with its measurement replaced by ``measured`` (:func:`record_measurement`) in this
    lnmonitor's record format: the training part stays, an older format's figures go."""
    kept = {k: v for k, v in record.items() if k not in OLD_MEASUREMENT}
    return {**kept, **measured, "format": RECORD_FORMAT, "val_loss": measured["headline"]["val_loss"]}


def _versions() -> dict:
    import lightning
    import torch

    import lnmonitor

    return {"lnmonitor": lnmonitor.__version__, "torch": torch.__version__,
            "lightning": lightning.__version__, "python": sys.version.split()[0]}
