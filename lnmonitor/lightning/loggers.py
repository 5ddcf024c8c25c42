"""Where each lnmonitor Lightning callback's numbers go: its :class:`Loggers`.

Every logger in ``trainer.loggers``, from global rank zero (TensorBoard gets a step's scalars as one event,
plus a custom-scalars layout and one HPARAMS session merged over every lnmonitor callback of the run, and
histograms); :attr:`Loggers.history` keeps them when the Trainer has no logger or when asked.  A logged step
never goes back (a resumed fit logs no step twice); :meth:`Loggers.setup` resets what belongs to one fit.
What belongs to one logger is keyed by the logger object itself (weakly), never by its reused ``id``.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch import Tensor

from lnmonitor.core.meter.meter import LadderResult
from lnmonitor.core.monitor.shared import History, Messages, warn_at_user
from lnmonitor.core.output.metric_names import CATEGORY_ORDER, HEADLINE_METRICS, hist_metric
from lnmonitor.core.output.writers import write_scalars

__all__ = ["Loggers", "write_histogram"]


class _Board:
    """What the :class:`Loggers` writing to one TensorBoard run share: the merged custom-scalars layout and
    the run's one HPARAMS session."""

    def __init__(self) -> None:
        self.layout: dict[str, dict] = {}
        self.expected: weakref.WeakSet = weakref.WeakSet()
        self.given: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Loggers -> (params, metrics)
        self.written = False


_BOARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _board(logger: TensorBoardLogger) -> _Board:
    return _BOARDS.setdefault(logger.experiment, _Board())


def _tensorboard_loggers(trainer) -> list[TensorBoardLogger]:
    return [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


class Loggers:
    """The logging side of one callback (``name``: its class name, for messages; ``messages`` says them)."""

    def __init__(self, name: str, keep_history: bool | None, messages: Messages | None = None) -> None:
        self.name = name
        self.messages = messages or Messages(info=rank_zero_info, warn=rank_zero_only(warn_at_user))
        self.kept = History(keep_history)
        self.histograms = False  # TensorBoard histograms of a measured step's rows (LayerNormMonitor's)
        self.last_step = -1
        self._layout: dict[str, dict] = {}
        self._ready: weakref.WeakSet = weakref.WeakSet()

    @property
    def history(self) -> list[dict[str, float]]:
        return self.kept.rows

    def setup(self, trainer, *, hparams: bool = False) -> None:
        """Start a fit (or a validation run): forget the last one's steps, decide where the history goes,
        and with ``hparams`` announce a share of the HPARAMS session (given by :meth:`give_hparams`)."""
        self.last_step = -1
        self._ready = weakref.WeakSet()
        self.messages.reset(speaks=trainer.is_global_zero)
        self.kept.reset(receivers=bool(trainer.loggers))
        if not trainer.loggers and trainer.is_global_zero:
            self.warn_once("no-logger", f"{self.name}: the Trainer has no logger, so the metrics stay in "
                           f"`{self.name}.history` (a list of dicts with a 'step' key). Pass a logger (e.g. "
                           "TensorBoardLogger) to see them in a dashboard.")
        if hparams and trainer.is_global_zero:
            for logger in _tensorboard_loggers(trainer):
                board = _board(logger)
                if not board.written:
                    board.expected.add(self)

    def give_hparams(self, trainer, pl_module, params: dict[str, Any], metrics: list[str]) -> bool:
        """This callback's columns of the run's HPARAMS session, written (with the module's and datamodule's
        hyperparameters) once every callback announced at setup has given its share: TensorBoard keeps a
        run's first session.  True when a TensorBoard run's session takes them (global rank zero)."""
        taken = False
        for logger in _tensorboard_loggers(trainer) if trainer.is_global_zero else ():
            board = _board(logger)
            if board.written:
                continue
            board.given[self] = (params, metrics)
            taken = True
            if all(loggers in board.given for loggers in board.expected):
                _write_session(logger, board, trainer, pl_module)
        return taken

    def add_layout(self, categories: dict[str, dict]) -> None:
        """Custom-scalars categories, written to each TensorBoard run with the first log there."""
        self._layout.update(categories)

    def log(self, trainer, step: int, metrics: dict[str, float], result: LadderResult | None = None, *,
            extend: bool = False) -> bool:
        """Log ``metrics`` at ``step`` unless that step was logged already (False then); only global rank
        zero writes.  With :attr:`histograms`, a measured step's ``result`` adds TensorBoard histograms of
        each norm's shares and sigmas (a failure is said once).  ``extend``: add metrics measured later
        to the step logged last."""
        again = extend and step == self.last_step
        if step <= self.last_step and not again:
            return False
        self.last_step = step
        self.kept.add(step, metrics, extend=again)
        if not trainer.is_global_zero:
            return True
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger):
                logger.log_metrics(metrics, step=step)
                continue
            if logger not in self._ready:
                self._ready.add(logger)
                if self._layout:
                    _write_layout(logger, self._layout)
            if self.histograms and result is not None:
                try:
                    _write_histograms(logger.experiment, step, result)
                except Exception as err:  # noqa: BLE001 - extras must never stop training
                    self.warn_once("extras", f"{self.name}: TensorBoard extras skipped: {err!r}")
            if not _write_scalars(logger, metrics, step):
                logger.log_metrics(metrics, step=step)
        return True

    def log_image(self, trainer, tag: str, step: int, image) -> None:
        """An ``(H, W, 3)`` uint8 picture to every logger that takes images, from global rank zero:
        TensorBoard, W&B and Neptune (``log_image``), MLflow (an artifact per step)."""
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            try:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_image(tag, image, step, dataformats="HWC")
                elif type(logger).__name__ == "MLFlowLogger":
                    logger.experiment.log_image(logger.run_id, image, f"{tag}/step_{step:08d}.png")
                elif callable(getattr(logger, "log_image", None)):
                    logger.log_image(key=tag, images=[image], step=step)
            except Exception as err:  # noqa: BLE001 - a picture must never stop training
                where = type(logger).__name__
                self.warn_once("images", f"{self.name}: pictures not logged to {where}: {err!r}")

    def warn_once(self, key: str, message: str) -> None:
        """Warn (global rank zero) the first time ``key`` comes up in this fit."""
        self.messages.warn(key, message)


def _write_layout(logger: TensorBoardLogger, categories: dict[str, dict]) -> None:
    """Merge ``categories`` into the run's custom-scalars layout and write it again (the plugin reads the
    latest)."""
    board = _board(logger)
    board.layout.update(categories)
    keys = sorted(board.layout, key=lambda k: (
        CATEGORY_ORDER.index(k) if k in CATEGORY_ORDER else len(CATEGORY_ORDER), k))
    logger.experiment.add_custom_scalars({k: board.layout[k] for k in keys})


def _hparam_value(value):
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _flat(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        key = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{key}/"))
        else:
            out[key] = _hparam_value(value)
    return out


def _module_hparams(trainer, pl_module) -> dict[str, Any]:
    """The module's and datamodule's hyperparameters, without long strings (a vocabulary): no column."""
    params: dict[str, Any] = {}
    if getattr(pl_module, "_log_hyperparams", True):
        params.update(dict(pl_module.hparams_initial))
    dm = trainer.datamodule
    if dm is not None and getattr(dm, "_log_hyperparams", True):
        params.update(dict(getattr(dm, "hparams_initial", {}) or {}))
    params.pop("_class_path", None)
    return {k: v for k, v in params.items() if not (isinstance(v, str) and len(v) > 64)}


def _headline_rank(name: str) -> int:
    """Where a metric goes among the HPARAMS columns: by ``HEADLINE_METRICS``, then the rest."""
    ranks = [i for i, head in enumerate(HEADLINE_METRICS) if name.startswith(head)]
    return ranks[0] if ranks else len(HEADLINE_METRICS)


def _write_session(logger: TensorBoardLogger, board: _Board, trainer, pl_module) -> None:
    from lnmonitor.views.hparams_session import session_protos

    params, names = {}, []
    for p, n in board.given.values():
        params.update(p)
        names += [x for x in n if x not in names]
    names.sort(key=_headline_rank)  # stable: the rest keep their order
    if getattr(logger, "_default_hp_metric", False):
        names.append("hp_metric")
    merged = {**_flat(_module_hparams(trainer, pl_module)), **params}
    writer = logger.experiment._get_file_writer()
    for proto in session_protos(merged, names):  # eps, seed and the monitors' own in view
        writer.add_summary(proto)
    board.written = True


def _write_scalars(logger: TensorBoardLogger, metrics: dict[str, float], step: int) -> bool:
    """All ``metrics`` as one event in the logger's run, under its prefix."""
    prefix = getattr(logger, "_prefix", "")
    join = getattr(logger, "LOGGER_JOIN_CHAR", "-")
    return write_scalars(logger.experiment, metrics, step, f"{prefix}{join}" if prefix else "")


def _write_histograms(writer, step: int, result: LadderResult) -> None:
    for info, stats, figures in zip(result.norms, result.row_stats, result.figures.norms, strict=True):
        write_histogram(writer, hist_metric("share", info.name), step,
                        stats.share_counts, stats.layout.share_edges(), group=64)
        sigma_edges = np.sqrt(stats.layout.value_edges() + figures.eps)
        write_histogram(writer, hist_metric("sigma", info.name), step,  # 1/8 octave buckets
                        stats.var_counts, sigma_edges, group=16)


def write_histogram(writer, tag: str, step: int, counts, edges, group: int) -> None:
    """Coarsen a fixed-bin histogram by ``group`` bins and write it as a TensorBoard histogram (sum and sum of
    squares from the bucket centres)."""
    counts = np.asarray(counts, dtype=np.float64)
    nz = np.nonzero(counts)[0]
    if nz.size == 0:
        return
    lo, hi = (nz[0] // group) * group, min(((nz[-1] // group) + 1) * group, len(counts))
    c = counts[lo:hi]
    pad = (-len(c)) % group
    c = np.concatenate((c, np.zeros(pad))).reshape(-1, group).sum(1)
    e = np.asarray(edges, dtype=np.float64)
    limits = e[np.minimum(np.arange(lo + group, lo + group * (len(c) + 1), group), len(e) - 1)]
    lowers = np.concatenate(([e[lo]], limits[:-1]))
    centres = (lowers + limits) / 2
    writer.add_histogram_raw(
        tag, min=float(e[lo]), max=float(limits[-1]), num=float(c.sum()),
        sum=float((c * centres).sum()), sum_squares=float((c * centres**2).sum()),
        bucket_limits=limits.tolist(), bucket_counts=c.tolist(), global_step=step,
    )
