"""Layer 4: the Lightning callbacks (thin glue over taps, summaries and invariance).

* :class:`LayerNormMonitor`: the 1/sigma ladder and the dead-plane share of every
  selected normalisation layer, every ``every_n_steps`` optimizer steps.
* :class:`FinalNormInvarianceMonitor`: the final norm's shift/scale invariance on a
  fixed held-out probe batch, at its own cadence and after each validation.

Both log through every logger in ``trainer.loggers`` (rank zero only), add a custom
scalars layout and hyperparameters when a TensorBoard logger is present, keep their
results in ``history`` when there is no logger, and resume their cadence from a
checkpoint.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from lightning.fabric.loggers.tensorboard import TensorBoardLogger as _TensorBoardLogger
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lnmonitor import geometry
from lnmonitor.invariance import (
    CASES,
    SWEEP_SCALES,
    InvarianceResult,
    final_norm_bypass,
    final_norm_invariance,
    find_final_norm,
)
from lnmonitor.summaries import Layout, NormSummary, merge, read, summarise
from lnmonitor.taps import NormInfo, NormTap, compiled, eager, find_norms, select_norms

__all__ = ["FinalNormInvarianceMonitor", "LayerNormMonitor"]

PREFIX = "lnmonitor"


# ---------------------------------------------------------------------------
# shared helpers: argument checks, logging, TensorBoard extras
# ---------------------------------------------------------------------------


def _check_every(value, name: str, allow_none: bool = True, unit: str = "optimizer steps") -> int | None:
    if value is None and allow_none:
        return None
    try:  # any integer type (int, numpy integers), never a bool or a float
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < 1:
        hint = " or None" if allow_none else ""
        raise MisconfigurationException(
            f"{name} must be a positive integer ({unit}){hint}, got {value!r}"
        )
    return int(number)


def _check_patterns(value, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        items: tuple = (value,)
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray, Mapping)):
        items = tuple(value)
    else:
        items = ()
    if not items or not all(isinstance(p, str) and p for p in items):
        raise MisconfigurationException(
            f"{name} must be a glob pattern or a list of glob patterns over qualified module "
            f"names (e.g. 'model.blocks.*.ln1'), got {value!r}"
        )
    return items


def _check_optional_bool(value, name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise MisconfigurationException(f"{name} must be True, False or None, got {value!r}")
    return value


def _check_name(value, name: str) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise MisconfigurationException(
            f"{name} must be the qualified name of a norm module (e.g. 'model.lnf') or None, "
            f"got {value!r}"
        )
    return value


def _no_norm_message(owner: str, pl_module: LightningModule) -> str:
    types = sorted({type(m).__name__ for m in pl_module.modules()})
    return (
        f"{owner} found no normalisation layer in {type(pl_module).__name__} "
        f"({sum(1 for _ in pl_module.modules())} modules of types {', '.join(types)}). "
        "It looks for nn.LayerNorm, nn.RMSNorm and modules with `normalized_shape`, `eps` and "
        "`weight` attributes; declare others with a class attribute "
        "`lnmonitor_norm_kind = 'layer'` (or 'rms') or `lnmonitor.register_norm(cls, kind)`, "
        "or remove the callback."
    )


def _say_measured_eps(owner: str, norms: Sequence[NormInfo]) -> None:
    measured = [n for n in norms if n.eps_measured]
    if not measured:
        return
    values = sorted({n.eps() for n in measured})
    classes = sorted({type(n.module).__name__ for n in measured})
    rank_zero_info(
        f"{owner}: {', '.join(n.name for n in measured[:4])}{', ...' if len(measured) > 4 else ''} "
        f"({', '.join(classes)}) has no eps attribute; the eps its forward applies, measured "
        f"from its output, is {', '.join(f'{e:g}' for e in values)} (used for sigma, eps/var "
        f"and the transmission). To state it instead: lnmonitor.register_norm({classes[0]}, "
        f"{measured[0].kind!r}, eps=<value>)."
    )


def _is_tb(logger) -> bool:
    return isinstance(logger, _TensorBoardLogger)


_TB_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tb_state(experiment) -> dict:
    try:
        return _TB_STATE.setdefault(experiment, {"layout": {}, "params": {}, "metrics": []})
    except TypeError:  # not weak-referenceable: keep it on the object
        state = getattr(experiment, "_lnmonitor_tb_state", None)
        if state is None:
            state = {"layout": {}, "params": {}, "metrics": []}
            experiment._lnmonitor_tb_state = state
        return state


def _tb_add_layout(logger, categories: dict[str, dict[str, list]]) -> None:
    """Merge ``categories`` into the run's custom-scalars layout and write it again (the
    TensorBoard plugin reads the latest layout, so both monitors' categories survive)."""
    experiment = logger.experiment
    state = _tb_state(experiment)
    state["layout"].update(categories)
    order = ["lnmonitor: 1/sigma ladder", "lnmonitor: dead-plane share"]
    keys = sorted(state["layout"], key=lambda k: (order.index(k) if k in order else len(order), k))
    experiment.add_custom_scalars({k: state["layout"][k] for k in keys})


def _hparam_value(value):
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _module_hparams(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if getattr(pl_module, "_log_hyperparams", True):
        params.update(dict(pl_module.hparams_initial))
    dm = trainer.datamodule
    if dm is not None and getattr(dm, "_log_hyperparams", True):
        params.update(dict(getattr(dm, "hparams_initial", {}) or {}))
    params.pop("_class_path", None)
    return params


def _flat(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        key = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{key}/"))
        else:
            out[key] = _hparam_value(value)
    return out


def _tb_write_hparams(trainer: Trainer, pl_module: LightningModule) -> None:
    """Write the HPARAMS-tab session once per TensorBoard run, at setup.

    TensorBoard keeps the *first* hparams summary of a run, and Lightning writes the
    module's own right after the callbacks' ``setup``; so the first monitor to set up
    writes one session for every lnmonitor monitor of the Trainer: the module's (and
    datamodule's) hyperparameters plus the monitors' (norm kind, eps, width, final norm),
    listing the monitors' headline metrics (their values are the logged scalars).
    """
    try:
        from torch.utils.tensorboard.summary import hparams
    except ImportError:  # pragma: no cover - tensorboardX-only installs
        from tensorboardX.summary import hparams
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, _Logged)]
    for logger in trainer.loggers:
        if not _is_tb(logger):
            continue
        state = _tb_state(logger.experiment)
        if state.get("hparams_written"):
            continue
        params, names = {}, []
        for cb in monitors:
            p, n = cb._hparams(trainer, pl_module)
            params.update(p)
            names += [x for x in n if x not in names]
        if getattr(logger, "_default_hp_metric", False):
            names.insert(0, "hp_metric")
        merged = {**_flat(_module_hparams(trainer, pl_module)), **params}
        exp, ssi, sei = hparams(merged, {name: 0.0 for name in names})
        writer = logger.experiment._get_file_writer()
        for summary in (exp, ssi, sei):
            writer.add_summary(summary)
        state["hparams_written"] = True


def _tb_log_scalars(logger, metrics: dict[str, float], step: int) -> bool:
    """Write all ``metrics`` as one TensorBoard event (what ``log_metrics`` writes as one
    event per scalar, ~30 us each); False when the writer is not torch's/tensorboardX's."""
    try:
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = logger.experiment._get_file_writer()
        prefix = getattr(logger, "_prefix", "")
        join = getattr(logger, "LOGGER_JOIN_CHAR", "-")
        values = [
            Summary.Value(tag=f"{prefix}{join}{k}" if prefix else k, simple_value=float(v))
            for k, v in metrics.items()
        ]
        writer.add_summary(Summary(value=values), step)
    except Exception:  # noqa: BLE001 - any other writer: the logger's own path
        return False
    return True


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}


class _Logged:
    """Cadence bookkeeping, history and the no-logger warning shared by both monitors."""

    def _init_logging(self, keep_history: bool | None) -> None:
        self.history: list[dict[str, float]] = []
        self._keep_history_arg = keep_history
        self._keep_history = bool(keep_history)
        self._last_logged_step = -1
        self._tb_ready: set[int] = set()
        self._warned_no_logger = False

    def _hparams(self, trainer: Trainer, pl_module: LightningModule) -> tuple[dict, list[str]]:
        return {}, []

    def _setup_logging(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            _tb_write_hparams(trainer, pl_module)
        if self._keep_history_arg is None:
            self._keep_history = not trainer.loggers
        if not trainer.loggers and trainer.is_global_zero and not self._warned_no_logger:
            self._warned_no_logger = True
            rank_zero_warn(
                f"{type(self).__name__}: the Trainer has no logger, so the metrics stay in "
                f"`{type(self).__name__}.history` (a list of dicts with a 'step' key). "
                "Pass a logger (e.g. TensorBoardLogger) to see them in a dashboard."
            )

    def _write(self, trainer: Trainer, step: int, metrics: dict[str, float], tb_extra) -> bool:
        """Log ``metrics`` at ``step`` unless that step was logged already; rank zero writes."""
        if step <= self._last_logged_step:
            return False
        self._last_logged_step = step
        if self._keep_history:
            self.history.append({"step": step, **metrics})
        if not trainer.is_global_zero:
            return True
        for logger in trainer.loggers:
            if _is_tb(logger):
                first = id(logger) not in self._tb_ready
                self._tb_ready.add(id(logger))
                try:
                    tb_extra(logger, step, first)
                except Exception as err:  # noqa: BLE001 - extras must never stop training
                    rank_zero_warn(f"{type(self).__name__}: TensorBoard extras skipped: {err!r}")
                if _tb_log_scalars(logger, metrics, step):
                    continue
            logger.log_metrics(metrics, step=step)
        return True


def _tags(names: Sequence[str]) -> list[str]:
    return [re.escape(n) for n in names]


# ---------------------------------------------------------------------------
# LayerNormMonitor
# ---------------------------------------------------------------------------


class LayerNormMonitor(_Logged, Callback):
    r"""Watch every normalisation layer's 1/sigma ladder and dead-plane share.

    Every ``every_n_steps`` optimizer steps (default: the Trainer's
    ``log_every_n_steps``; gradient accumulation does not multiply the count) the
    selected norms are hooked for the whole step, over every row (token) of the global
    batch: all micro-batches and, under DDP, all ranks.  On the other steps no hook is
    registered.  Per row the monitor measures, in float32 on the device, the norm's
    input variance ``v`` (mean square for RMSNorm), the stream's mean square, and the
    share of ``w = gain * dL/dy`` in the norm's dead subspace (span{1, xhat}, or
    span{xhat} for RMSNorm); see DESIGN.md.  The rows are summarised in fixed-bin
    histograms (:mod:`lnmonitor.summaries`: share resolved to 2.4e-4, sigma and rms to
    0.29% relative, eps/var to 0.58%), reduced across ranks with one ``all_gather`` per
    logging step, and read on the host once.

    Args:
        every_n_steps: measure the steps whose index (``trainer.global_step`` before the
            update) is a multiple of this; ``None`` uses ``trainer.log_every_n_steps``.
        include: glob pattern(s) over qualified module names (``fnmatch``: ``"*.ln1"``,
            ``"model.blocks.*"``); only matching norms are measured.  ``None``: all.
        exclude: glob pattern(s) of norms to leave out.
        final_norm: qualified name of the final norm (the ladder's last rung); ``None``
            takes the last selected norm to run in the forward.
        histograms: also write TensorBoard histograms of the per-row share and sigma.
        keep_history: keep every logged dict in ``history``; ``None`` keeps them only
            when the Trainer has no logger.

    Logged metrics (``<norm>`` is the norm's qualified name in the LightningModule,
    e.g. ``model.blocks.0.ln1``; all are over the rows of one measured step):

    ==========================================  ==============================================
    ``lnmonitor/sigma/<norm>``                  median ``sqrt(v + eps)`` of the input rows
                                                (units of the input)
    ``lnmonitor/inv_sigma/<norm>``              ``1 / sigma``: the norm's gain on the residual
                                                stream (1 / input units); the ladder
    ``lnmonitor/rms/<norm>``                    median ``sqrt(mean(x^2))`` of the stream the
                                                norm reads (input units)
    ``lnmonitor/eps_over_var/<norm>``           median ``eps / v`` (dimensionless)
    ``lnmonitor/transmission/<norm>``           median ``eps / (v + eps)``: the fraction the
                                                Jacobian passes along the scale direction
    ``lnmonitor/share_median/<norm>``           median dead-plane share ``|P w| / |w|`` (0..1)
    ``lnmonitor/share_p90/<norm>``              its 90th percentile
    ``lnmonitor/share_max/<norm>``              its exact maximum
    ``lnmonitor/skipped_rows/<norm>``           rows without a share (zero or non-finite
                                                gradient or input, constant row), count
    ``lnmonitor/share_baseline/median``         median share of a random direction for this
                                                width and dead-subspace dimension
    ``lnmonitor/share_baseline/max``            median of the max of as many random rows as
                                                were measured (compare with ``share_max``)
    ``lnmonitor/ladder/attenuation``            ``inv_sigma(first norm) / inv_sigma(final)``
    ``lnmonitor/ladder/growth``                 ``rms(final) / rms(first norm)``
    ==========================================  ==============================================

    When the selected norms differ in width or kind, the baselines are logged per norm
    as ``lnmonitor/share_baseline/median/<norm>`` and ``.../max/<norm>``.  With a
    TensorBoard logger: a custom-scalars layout (the whole ladder, the shares against
    their baselines, each as one multi-line chart), the norm kind, eps and width in the
    HPARAMS tab, and with ``histograms=True`` ``lnmonitor/hist/share/<norm>`` and
    ``lnmonitor/hist/sigma/<norm>``.

    What real training throws at it (tests/test_robustness.py):

    * autocast (bf16, fp16 with a GradScaler): rows are reduced in float32; the share is
      a ratio, so the loss scale cancels; rows whose gradient or input is zero or not
      finite (an fp16 overflow, a NaN) are skipped and counted in ``skipped_rows``;
    * gradient accumulation: one measured step covers all its micro-batches;
    * ``torch.compile``: compiled code does not run hooks registered after it compiled, so
      the measured steps run eagerly (``torch.compiler.set_stance("force_eager")``, said
      once at setup) and the others run the compiled code;
    * activation checkpointing: every norm call is measured once (see
      :mod:`lnmonitor.taps`);
    * a selected norm that gets no row in a measured step (never called, or hidden from
      the hooks) is named in a warning, once; nothing is made up for it.

    Example::

        trainer = L.Trainer(callbacks=[LayerNormMonitor(), FinalNormInvarianceMonitor()],
                            logger=TensorBoardLogger("runs"))
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        final_norm: str | None = None,
        histograms: bool = False,
        keep_history: bool | None = None,
    ) -> None:
        super().__init__()
        self._every_arg = _check_every(every_n_steps, "every_n_steps")
        self.include = _check_patterns(include, "include")
        self.exclude = _check_patterns(exclude, "exclude")
        self.final_norm = _check_name(final_norm, "final_norm")
        if not isinstance(histograms, bool):
            raise MisconfigurationException(f"histograms must be True or False, got {histograms!r}")
        self.histograms = histograms
        self._init_logging(_check_optional_bool(keep_history, "keep_history"))
        self.every_n_steps: int | None = self._every_arg
        self.norms: list[NormInfo] = []
        self.order: list[str] = []
        self._tap: NormTap | None = None
        self._layout: Layout | None = None
        self._measuring: int | None = None
        self._stance = None
        self._warned_unmeasured = False
        self.last_summaries: list[NormSummary] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_steps=self._every_arg, include=self.include, exclude=self.exclude
        )

    # -- setup ---------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        found = find_norms(pl_module)
        if not found:
            raise MisconfigurationException(_no_norm_message("LayerNormMonitor", pl_module))
        selected = select_norms(found, self.include, self.exclude)
        names = [n.name for n in found]
        if not selected:
            raise MisconfigurationException(
                f"LayerNormMonitor: include={self.include} exclude={self.exclude} select none "
                f"of the {len(found)} normalisation layers found: {', '.join(names)}. Fix the patterns "
                "(fnmatch globs over these names)."
            )
        for info in selected:
            if info.width is not None and info.width <= info.dead_dim:
                raise MisconfigurationException(
                    f"LayerNormMonitor: norm {info.name!r} has width {info.width}, not more than "
                    f"its dead-subspace dimension {info.dead_dim} ({info.kind} norm): the dead "
                    "subspace is the whole space and the share is trivially 1. Leave it out "
                    f"with exclude=[{info.name!r}]."
                )
        if self.final_norm is not None and self.final_norm not in [n.name for n in selected]:
            where = "is excluded by include/exclude" if self.final_norm in names else "is not a norm"
            raise MisconfigurationException(
                f"LayerNormMonitor: final_norm={self.final_norm!r} {where}; the selected norms "
                f"are {', '.join(n.name for n in selected)}."
            )
        self.norms = selected
        self._tap = NormTap(selected)
        self._layout = Layout(len(selected))
        self.every_n_steps = self._every_arg or max(int(trainer.log_every_n_steps), 1)
        self._setup_logging(trainer, pl_module)
        _say_measured_eps("LayerNormMonitor", selected)
        if compiled(pl_module):
            rank_zero_info(
                "LayerNormMonitor: the model is compiled (torch.compile); its measured steps run "
                "eagerly (torch.compiler.set_stance('force_eager')) so that the norm hooks see "
                "every call, and the other steps run the compiled code."
            )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception) -> None:
        self._stop()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._tap is not None:
            self._tap.detach()
            self._tap.collect()
        self._measuring = None
        self._leave_eager()

    def _leave_eager(self) -> None:
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)

    # -- the measured step -----------------------------------------------------

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tap is None or self._measuring is not None:
            return
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step > self._last_logged_step:
            self._measuring = step
            # compiled code ignores hooks registered after it compiled (and hooks present
            # while it compiles break its graph): the measured step runs eagerly
            self._stance = eager()
            self._stance.__enter__()
            self._tap.attach()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring is None or trainer.global_step == self._measuring:
            return  # not measuring, or still accumulating gradients for this step
        step = self._measuring
        self._measuring = None
        self._tap.detach()
        self._leave_eager()
        rows = self._tap.collect()
        if rows.order:
            self.order = [self.norms[i].name for i in rows.order]
        flat = summarise(rows, self._layout, pl_module.device)
        if trainer.world_size > 1:
            flat = trainer.strategy.all_gather(flat)
        summaries = read(merge(flat, self._layout), self._layout, counts=self.histograms)
        eps = {i: rows.eps.get(i, info.eps()) for i, info in enumerate(self.norms)}
        self.last_summaries = summaries
        self._warn_unmeasured(step, summaries)
        metrics = _finite(self._metrics(summaries, eps))
        self._write(
            trainer, step, metrics,
            lambda logger, s, first: self._tb_extra(logger, s, first, summaries, eps),
        )

    def _warn_unmeasured(self, step: int, summaries: list[NormSummary]) -> None:
        """Say once when selected norms had no row in a measured step (never zero data
        without a word): a norm the forward does not call, or a model run by code the hooks
        cannot see (e.g. torch.compile on a torch without set_stance, TorchScript)."""
        missing = [info.name for info, s in zip(self.norms, summaries, strict=True) if s.rows == 0]
        if not missing or self._warned_unmeasured:
            return
        self._warned_unmeasured = True
        if len(missing) == len(self.norms):
            what = f"none of the {len(missing)} selected norms ran with gradient"
        else:
            what = f"{len(missing)} of the {len(self.norms)} selected norms did not run with gradient"
        rank_zero_warn(
            f"LayerNormMonitor: {what} during the measured step {step} ({', '.join(missing[:8])}"
            f"{', ...' if len(missing) > 8 else ''}), so nothing is logged for them. Either the "
            "forward does not call these modules (leave them out with exclude=[...]) or it runs "
            "code the module hooks cannot see (torch.compile without torch.compiler.set_stance, "
            "TorchScript). Said once."
        )

    def _metrics(self, summaries: list[NormSummary], eps: dict[int, float]) -> dict[str, float]:
        m: dict[str, float] = {}
        inv_sigma, rms = {}, {}
        for i, (info, s) in enumerate(zip(self.norms, summaries, strict=True)):
            n = info.name
            v = s.var_median
            sigma = math.sqrt(v + eps[i])
            inv_sigma[n], rms[n] = 1.0 / sigma, math.sqrt(s.ms_median)
            m[f"{PREFIX}/sigma/{n}"] = sigma
            m[f"{PREFIX}/inv_sigma/{n}"] = inv_sigma[n]
            m[f"{PREFIX}/rms/{n}"] = rms[n]
            m[f"{PREFIX}/eps_over_var/{n}"] = eps[i] / v if v > 0 else math.nan
            m[f"{PREFIX}/transmission/{n}"] = eps[i] / (v + eps[i])
            m[f"{PREFIX}/share_median/{n}"] = s.share_median
            m[f"{PREFIX}/share_p90/{n}"] = s.share_p90
            m[f"{PREFIX}/share_max/{n}"] = s.share_max
            m[f"{PREFIX}/skipped_rows/{n}"] = float(s.skipped_rows)
        m.update(self._baselines(summaries))
        order = [n for n in self.order if n in inv_sigma] or [n.name for n in self.norms]
        first = order[0]
        last = self.final_norm if self.final_norm is not None else order[-1]
        if first != last:
            m[f"{PREFIX}/ladder/attenuation"] = inv_sigma[first] / inv_sigma[last]
            m[f"{PREFIX}/ladder/growth"] = rms[last] / rms[first]
        return m

    def _baselines(self, summaries: list[NormSummary]) -> dict[str, float]:
        shapes = {(info.width, info.dead_dim) for info in self.norms}
        out = {}
        if len(shapes) == 1 and None not in next(iter(shapes)):
            d, k = next(iter(shapes))
            n = max(s.share_rows for s in summaries)
            out[f"{PREFIX}/share_baseline/median"] = _baseline_median(d, k)
            if n >= 1:
                out[f"{PREFIX}/share_baseline/max"] = _baseline_max(d, k, n)
            return out
        for info, s in zip(self.norms, summaries, strict=True):
            if info.width is None or info.width <= info.dead_dim:
                continue
            out[f"{PREFIX}/share_baseline/median/{info.name}"] = _baseline_median(
                info.width, info.dead_dim
            )
            if s.share_rows >= 1:
                out[f"{PREFIX}/share_baseline/max/{info.name}"] = _baseline_max(
                    info.width, info.dead_dim, s.share_rows
                )
        return out

    def _hparams(self, trainer: Trainer, pl_module: LightningModule) -> tuple[dict, list[str]]:
        norms = self.norms or select_norms(find_norms(pl_module), self.include, self.exclude)
        if not norms:
            return {}, []
        dtype = next((p.dtype for p in pl_module.parameters() if p.is_floating_point()), torch.float32)
        kinds = sorted({n.kind for n in norms})
        epss = sorted({n.eps(dtype) for n in norms})
        widths = sorted({n.width for n in norms if n.width is not None})
        p = PREFIX
        every = self._every_arg or max(int(trainer.log_every_n_steps), 1)
        params = {
            f"{p}/norm_kind": ",".join(kinds),
            f"{p}/eps": epss[0] if len(epss) == 1 else ",".join(f"{e:g}" for e in epss),
            f"{p}/width": widths[0] if len(widths) == 1 else ",".join(map(str, widths)),
            f"{p}/n_norms": len(norms),
            f"{p}/every_n_steps": every,
        }
        last = self.final_norm or norms[-1].name
        return params, [f"{p}/ladder/attenuation", f"{p}/ladder/growth", f"{p}/share_median/{last}"]

    # -- TensorBoard extras ------------------------------------------------------

    def _tb_extra(self, logger, step: int, first: bool, summaries, eps) -> None:
        if first:
            order = [n for n in self.order] or [n.name for n in self.norms]
            order += [n.name for n in self.norms if n.name not in order]
            p = PREFIX
            _tb_add_layout(logger, {
                "lnmonitor: 1/sigma ladder": {
                    "1/sigma by norm, in forward order": ["Multiline", _tags(
                        [f"{p}/inv_sigma/{n}" for n in order])],
                    "rms of the stream each norm reads": ["Multiline", _tags(
                        [f"{p}/rms/{n}" for n in order])],
                    "eps/var by norm": ["Multiline", _tags(
                        [f"{p}/eps_over_var/{n}" for n in order])],
                    "ladder attenuation and growth": ["Multiline", _tags(
                        [f"{p}/ladder/attenuation", f"{p}/ladder/growth"])],
                },
                "lnmonitor: dead-plane share": {
                    "median share vs random median": ["Multiline", _tags(
                        [f"{p}/share_median/{n}" for n in order]) + [f"{p}/share_baseline/median.*"]],
                    "p90 share": ["Multiline", _tags([f"{p}/share_p90/{n}" for n in order])],
                    "max share vs random max": ["Multiline", _tags(
                        [f"{p}/share_max/{n}" for n in order]) + [f"{p}/share_baseline/max.*"]],
                    "skipped rows": ["Multiline", _tags([f"{p}/skipped_rows/{n}" for n in order])],
                },
            })
        if self.histograms:
            experiment = logger.experiment
            for i, (info, s) in enumerate(zip(self.norms, summaries, strict=True)):
                _add_raw_hist(experiment, f"{PREFIX}/hist/share/{info.name}", step,
                              s.share_counts, s.layout.share_edges(), group=64)
                sigma_edges = np.sqrt(10.0 ** s.layout.log_edges() + eps[i])
                _add_raw_hist(experiment, f"{PREFIX}/hist/sigma/{info.name}", step,
                              s.var_counts, sigma_edges, group=20)

    # -- checkpointing -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_logged_step": self._last_logged_step,
            "every_n_steps": self.every_n_steps,
            "order": list(self.order),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_logged_step = int(state_dict.get("last_logged_step", -1))
        if self._every_arg is None and state_dict.get("every_n_steps"):
            self.every_n_steps = int(state_dict["every_n_steps"])
        self.order = list(state_dict.get("order", []))


_BASELINES: dict[tuple, float] = {}


def _baseline_median(d: int, k: int) -> float:
    key = ("median", d, k)
    if key not in _BASELINES:
        _BASELINES[key] = float(geometry.share_median(d, k))
    return _BASELINES[key]


def _baseline_max(d: int, k: int, n: int) -> float:
    key = ("max", d, k, n)
    if key not in _BASELINES:
        if len(_BASELINES) > 4096:
            _BASELINES.clear()
        _BASELINES[key] = float(geometry.max_share_median(d, k, n))
    return _BASELINES[key]


def _add_raw_hist(experiment, tag: str, step: int, counts, edges, group: int) -> None:
    """Coarsen a fixed-bin histogram by ``group`` bins and write it as a TensorBoard
    histogram (sum and sum of squares from the bucket centres)."""
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
    experiment.add_histogram_raw(
        tag, min=float(e[lo]), max=float(limits[-1]), num=float(c.sum()),
        sum=float((c * centres).sum()), sum_squares=float((c * centres**2).sum()),
        bucket_limits=limits.tolist(), bucket_counts=c.tolist(), global_step=step,
    )


# ---------------------------------------------------------------------------
# FinalNormInvarianceMonitor
# ---------------------------------------------------------------------------


class FinalNormInvarianceMonitor(_Logged, Callback):
    r"""Check that the loss ignores shifts and scales of the final norm's input.

    On a fixed held-out probe batch, at step indices that are multiples of
    ``every_n_steps`` (before that step's update: taken as soon as the previous update is
    done, so that a checkpoint saved then records it; this includes the point after the
    last update) and after each validation (not the sanity check; a validation at a step
    already probed reuses that point), run
    :func:`lnmonitor.invariance.final_norm_invariance`: the five cases of DESIGN.md and
    the scale sweep.  The input is transformed in float64 inside a forward hook and the
    final norm evaluated in float64 there (only the final norm sees the transformed
    input), so for a LayerNorm the shift cases are exactly zero.  The model's train/eval
    mode and the RNG state are restored; only rank zero computes (no collectives, the
    other ranks go on training); a compiled model is probed eagerly.

    Before its first run it checks, with one gradient pass on the probe batch
    (:func:`lnmonitor.invariance.final_norm_bypass`), that the final norm's input reaches
    the loss only through the norm.  When it does not -- a model without a final norm,
    whose last norm sits inside a block -- the cases would read zero although the loss
    is not invariant: the monitor says so in a warning, sets ``disabled_reason`` and logs
    nothing.  Errors while probing (a ``loss_fn`` that returns no loss, ...) also turn it
    off with a warning instead of stopping the training.

    Args:
        every_n_steps: cadence in optimizer steps; ``None``: only after validation.
        on_validation: also run after each validation.
        probe_batch: the batch to probe (anything ``loss_fn`` accepts).  ``None``: the
            first batch of the datamodule's (or module's) ``val_dataloader()``, else the
            first training batch (with a warning: it is not held out).
        probe_size: keep only the first ``probe_size`` samples of each tensor of the
            probe batch (the runs are 13 forward passes of it); ``None`` keeps all.
        loss_fn: ``loss_fn(module, batch)`` returning the loss or ``(logits, loss)``;
            the default calls ``module(*batch)`` (e.g. ``forward(x, y)``) and accepts
            a loss or ``(logits, loss)``.
        final_norm: qualified name of the final norm; ``None`` finds the last
            normalisation layer to run in the forward.
        cases: the cases to run, a subset of ``("shift_5", "shift_1000", "scale_3",
            "scale_3_shift_5", "axis_5")``.
        scales: the sweep's scales (default ``1e3, 1e1, 1, 1e-1, 1e-2, 3e-3, 1e-3,
            1e-4``); an empty tuple skips the sweep.
        keep_history: keep every logged dict in ``history``; ``None`` keeps them only
            when the Trainer has no logger.

    Logged metrics (``<case>`` in ``shift_5``, ``shift_1000``, ``scale_3``,
    ``scale_3_shift_5``, ``axis_5``):

    ================================================  ========================================
    ``lnmonitor/invariance/<case>/dloss``             loss(transformed) - loss (nats); zero
                                                      for the shifts, eps-sized for the
                                                      scales, clearly non-zero for ``axis_5``
    ``lnmonitor/invariance/<case>/max_dlogit``        max |delta logit| (logit units), when
                                                      the forward returns logits
    ``lnmonitor/invariance/<case>/out_residual``      median over rows of
                                                      ``|xhat(Th) - xhat(h)| / |xhat(h)|`` in
                                                      float64 (= ``|a sigma/sigma_a - 1|``)
    ``lnmonitor/invariance/scale_slope``              slope of log|dloss| vs log(eps/v) over
                                                      the sweep points with 1e-5 < eps/v < 10
    ``lnmonitor/invariance/scale_constant``           exp(intercept) of that fit (nats)
    ``lnmonitor/invariance/scale_rounding_points``    sweep points with eps/v <= 1e-5 whose
                                                      loss moved: float32 rounding, not eps
    ================================================  ========================================

    The full result of the latest run (per-scale points included) is ``last_result``.
    """

    def __init__(
        self,
        every_n_steps: int | None = 1000,
        on_validation: bool = True,
        probe_batch: Any = None,
        probe_size: int | None = 8,
        loss_fn: Callable[[LightningModule, Any], Any] | None = None,
        final_norm: str | None = None,
        cases: Sequence[str] = CASES,
        scales: Sequence[float] = SWEEP_SCALES,
        keep_history: bool | None = None,
    ) -> None:
        super().__init__()
        self.every_n_steps = _check_every(every_n_steps, "every_n_steps")
        if not isinstance(on_validation, bool):
            raise MisconfigurationException(f"on_validation must be True or False, got {on_validation!r}")
        if self.every_n_steps is None and not on_validation:
            raise MisconfigurationException(
                "FinalNormInvarianceMonitor would never run: set every_n_steps to a positive "
                "integer or on_validation=True"
            )
        self.on_validation = on_validation
        self.probe_size = _check_every(probe_size, "probe_size", unit="samples")
        if loss_fn is not None and not callable(loss_fn):
            raise MisconfigurationException(
                f"loss_fn must be a callable loss_fn(module, batch) -> loss or (logits, loss), "
                f"got {loss_fn!r}"
            )
        self.loss_fn = loss_fn
        self.final_norm = _check_name(final_norm, "final_norm")
        if isinstance(cases, str):
            cases = (cases,)
        elif isinstance(cases, Iterable) and not isinstance(cases, (bytes, bytearray, Mapping)):
            cases = tuple(cases)
        else:
            cases = (cases,)
        bad = [c for c in cases if not isinstance(c, str) or c not in CASES]
        if not cases or bad or len(set(cases)) != len(cases):
            raise MisconfigurationException(
                f"cases must be a non-empty list of distinct names from {list(CASES)}, got "
                f"{list(cases)}"
            )
        self.cases = cases
        given, numbers_ = scales, None
        if isinstance(scales, Iterable) and not isinstance(scales, (str, bytes, bytearray, Mapping)):
            given = tuple(scales)
            if all(isinstance(a, numbers.Real) and not isinstance(a, bool) for a in given):
                try:
                    numbers_ = tuple(float(a) for a in given)
                except (TypeError, ValueError, OverflowError):
                    numbers_ = None
        if numbers_ is None:
            raise MisconfigurationException(f"scales must be a list of numbers, got {given!r}")
        scales = numbers_
        if any(not (math.isfinite(a) and a > 0) for a in scales) or len(set(scales)) != len(scales):
            raise MisconfigurationException(
                f"scales must be distinct finite numbers > 0, got {list(scales)}"
            )
        self.scales = scales
        self._init_logging(_check_optional_bool(keep_history, "keep_history"))
        self.probe_batch = probe_batch
        self.last_result: InvarianceResult | None = None
        self._probe: Any = None
        self._first_train_batch: Any = None
        self._last_started_step = -1
        self._final_name: str | None = self.final_norm
        self._enabled = False
        self._checked_final = False
        self.disabled_reason: str | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, cases=self.cases)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        found = find_norms(pl_module)
        if not found:
            raise MisconfigurationException(
                _no_norm_message("FinalNormInvarianceMonitor", pl_module)
            )
        if self.final_norm is not None and self.final_norm not in [n.name for n in found]:
            raise MisconfigurationException(
                f"FinalNormInvarianceMonitor: final_norm={self.final_norm!r} is not a "
                f"normalisation layer; found: {', '.join(n.name for n in found)}."
            )
        self._setup_logging(trainer, pl_module)
        _say_measured_eps("FinalNormInvarianceMonitor", found)
        self._enabled = self.disabled_reason is None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._enabled and self._last_logged_step < 0 and trainer.is_global_zero:
            when = (f"every {self.every_n_steps} optimizer steps" if self.every_n_steps else "")
            if self.on_validation:
                when += (" and " if when else "") + "after each validation"
            rank_zero_warn(
                f"FinalNormInvarianceMonitor never ran in this fit: it runs {when}, and no such "
                "point came (no validation ran?). Set every_n_steps, or add validation data."
            )

    def _disable(self, reason: str) -> None:
        self._enabled = False
        self.disabled_reason = reason
        rank_zero_warn(f"FinalNormInvarianceMonitor is off for the rest of this run: {reason}")

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._first_train_batch is None and self.probe_batch is None:
            self._first_train_batch = batch
        if step == self._last_started_step:
            return  # a later micro-batch of the same optimizer step
        self._last_started_step = step
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            self._run(trainer, pl_module, step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any, batch_idx: int
    ) -> None:
        # The point of step s (the weights after s updates) is taken as soon as update s is
        # done rather than at the start of step s: a checkpoint saved now (ModelCheckpoint
        # runs after the other callbacks) then records it, and the validation that may
        # follow at the same global step reuses it, so a fit resumed from this checkpoint
        # neither repeats nor misses it (this includes the point after the last update).
        step = trainer.global_step
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            self._run(trainer, pl_module, step)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.on_validation and not trainer.sanity_checking:
            self._run(trainer, pl_module, trainer.global_step)

    def _run(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        if not self._enabled or step <= self._last_logged_step:
            return
        if not trainer.is_global_zero:
            self._last_logged_step = step
            return
        probe = self._get_probe(trainer, pl_module)
        if probe is None:
            return
        autocast = trainer.precision_plugin.forward_context
        try:
            if self._final_name is None:
                self._final_name = find_final_norm(pl_module, probe, self.loss_fn)
            if not self._checked_final:
                self._checked_final = True
                bypass = final_norm_bypass(
                    pl_module, probe, self._final_name, loss_fn=self.loss_fn, autocast=autocast
                )
                if bypass > BYPASS_TOLERANCE:
                    how = ("final_norm=" if self.final_norm else "the last norm to run, ")
                    self._disable(
                        f"{how}{self._final_name!r} is not a final norm: part of the loss "
                        "gradient at its input goes around it (relative size "
                        f"{bypass:.3g}; a residual path carries that input on), so the loss is "
                        "not invariant to shifting or scaling it and there is no final-norm "
                        "invariance to check. The model seems to have no final norm before its "
                        "head; if it has one, name it with final_norm=..."
                    )
                    return
            result = final_norm_invariance(
                pl_module, probe, self._final_name, loss_fn=self.loss_fn, cases=self.cases,
                scales=self.scales, autocast=autocast,
            )
        except (ValueError, RuntimeError) as err:  # never stop the user's training
            self._disable(f"{err}")
            return
        self.last_result = result
        metrics = _finite(result.metrics())
        self._write(trainer, step, metrics, self._tb_extra)

    def _get_probe(self, trainer: Trainer, pl_module: LightningModule):
        if self._probe is not None:
            return self._probe
        batch = self.probe_batch
        if batch is None:
            batch = _first_val_batch(trainer, pl_module)
        if batch is None:
            batch = self._first_train_batch
            if batch is None:
                return None
            rank_zero_warn(
                "FinalNormInvarianceMonitor: no validation data to take a held-out probe batch "
                "from, so it probes the first training batch; pass probe_batch=... to choose."
            )
        if self.probe_size is not None:
            size = self.probe_size
            batch = apply_to_collection(
                batch, Tensor, lambda t: t[:size] if t.ndim > 0 else t
            )
        batch = apply_to_collection(batch, Tensor, lambda t: t.detach().clone())
        self._probe = trainer.strategy.batch_to_device(batch, pl_module.device)
        return self._probe

    def _tb_extra(self, logger, step: int, first: bool) -> None:
        if not first:
            return
        p = f"{PREFIX}/invariance"
        charts = {
            "delta-loss by case": ["Multiline", _tags([f"{p}/{c}/dloss" for c in self.cases])],
            "max |delta-logit| by case": ["Multiline", _tags(
                [f"{p}/{c}/max_dlogit" for c in self.cases])],
            "float64 norm-output residual by case": ["Multiline", _tags(
                [f"{p}/{c}/out_residual" for c in self.cases])],
        }
        if self.scales:
            charts["scale sweep: slope and constant"] = ["Multiline", _tags(
                [f"{p}/scale_slope", f"{p}/scale_constant"])]
        _tb_add_layout(logger, {"lnmonitor: final-norm invariance": charts})

    def _hparams(self, trainer: Trainer, pl_module: LightningModule) -> tuple[dict, list[str]]:
        p = f"{PREFIX}/invariance"
        names = [f"{p}/{c}/dloss" for c in ("scale_3", "axis_5") if c in self.cases]
        if self.scales:
            names.append(f"{p}/scale_slope")
        return {f"{PREFIX}/final_norm": self._final_name or "auto"}, names

    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_step": self._last_logged_step, "final_norm": self._final_name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_logged_step = int(state_dict.get("last_logged_step", -1))
        if self.final_norm is None and state_dict.get("final_norm"):
            self._final_name = state_dict["final_norm"]


# share of the loss gradient at the final norm's input allowed to go around the norm
# (a true final norm gives exactly 0: the two gradients are the same numbers)
BYPASS_TOLERANCE = 1e-6


def _first_val_batch(trainer: Trainer, pl_module: LightningModule):
    sources = []
    if trainer.datamodule is not None:
        sources.append(trainer.datamodule)
    sources.append(pl_module)
    for source in sources:
        getter = getattr(source, "val_dataloader", None)
        if getter is None:
            continue
        try:
            loaders = getter()
            if isinstance(loaders, (list, tuple)):
                loaders = loaders[0] if loaders else None
            if isinstance(loaders, dict):
                loaders = next(iter(loaders.values()), None)
            if loaders is None:
                continue
            return next(iter(loaders))
        except Exception:  # noqa: BLE001 - no usable validation data: fall back
            continue
    return None

