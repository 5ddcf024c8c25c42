r"""
LayerNorm Monitor
=================

Watch every normalisation layer's 1/sigma ladder and dead-plane share while training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lnmonitor import geometry
from lnmonitor.callbacks import arguments
from lnmonitor.callbacks.discovery import no_norm_message, refused_message, say_measured_eps
from lnmonitor.callbacks.sink import MetricSink, finite, write_histogram
from lnmonitor.hooks import compiled, eager
from lnmonitor.metric_names import PREFIX, per_norm
from lnmonitor.norms import FINAL, RUNGS, NormInfo, assign_roles, discover_norms, select_norms
from lnmonitor.pictures import heatmap_picture, ladder_picture
from lnmonitor.summaries import Layout, NormSummary, merge, read, summarise
from lnmonitor.summary import Trail, ladder_grid, summary_text
from lnmonitor.taps import NormTap

__all__ = ["LayerNormMonitor"]


class LayerNormMonitor(Callback):
    r"""Watch every normalisation layer's 1/sigma ladder and dead-plane share.

    Every ``every_n_steps`` optimizer steps (default: the Trainer's
    ``log_every_n_steps``; gradient accumulation does not multiply the count), and at the
    last optimizer step of the fit when the Trainer knows it, the
    selected norms are hooked for the whole step, over every row (token) of the global
    batch: all micro-batches and, under DDP, all ranks.  On the other steps no hook is
    registered.  Per row the monitor measures, in float32 on the device, the norm's
    input variance ``v`` (mean square for RMSNorm), the stream's mean square, and the
    share of ``w = gain * dL/dy`` in the norm's dead subspace (span{1, xhat}, or
    span{xhat} for RMSNorm); see docs/design.md.  The rows are summarised in fixed-bin
    histograms (:mod:`lnmonitor.summaries`: share resolved to 2.4e-4, sigma and rms to
    0.39% relative, eps/var to 0.78%, over the whole float32 range), reduced across ranks
    with one ``all_gather`` per logging step, and read on the host once.

    Args:
        every_n_steps: measure the steps whose index (``trainer.global_step`` before the
            update) is a multiple of this; ``None`` uses ``trainer.log_every_n_steps``.
        include: glob pattern(s) over qualified module names (``fnmatch``: ``"*.ln1"``,
            ``"model.blocks.*"``); only matching norms are measured.  ``None``: all.
        exclude: glob pattern(s) of norms to leave out.
        final_norm: qualified name of the final norm (the ladder's last rung); ``None``
            takes the last norm to run whose input gradient does not go around it.
        ladder: glob pattern(s) naming the norms that read the residual stream, the rungs
            of the 1/sigma ladder (e.g. ``"model.layers.*.input_layernorm"``); ``None``
            finds them on the first measured step: a norm whose input flows on past it
            (part of the gradient there goes around the norm) reads the stream, a QK-norm or
            a norm of a branch's output does not.  All selected norms are measured either
            way; only the rungs enter the attenuation and growth.
        histograms: also write TensorBoard histograms of the per-row share and sigma.
        images: log the ladder as a picture (1/sigma and rms of each rung against depth,
            the final norm marked; about 5 ms and 10 KB each) at measured steps at least
            ``image_every_n_steps`` apart and at the last, and 1/sigma of every rung against
            depth and step at the end of the fit, to every logger that takes images.
        image_every_n_steps: the least number of optimizer steps between two ladder
            pictures (default 50: every measured step at the default cadence, one in 50
            when every step is measured).
        summary: print a one-screen summary of the ladder and the shares at the end of the
            fit (global rank zero).
        keep_history: keep every logged dict in ``history``; ``None`` keeps them only
            when the Trainer has no logger.

    Raises:
        MisconfigurationException: in ``__init__`` for an argument of the wrong type or
            range; when the fit starts, if the model has no normalisation layer, the
            patterns select none, ``final_norm`` is not a selected norm, or a selected norm
            is too narrow for its dead subspace.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lnmonitor import LayerNormMonitor
        >>> monitor = LayerNormMonitor(every_n_steps=10)
        >>> trainer = Trainer(callbacks=[monitor])

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
    ``lnmonitor/log10_eps_over_var/<norm>``     ``log10`` of the median ``eps / v`` (these two
    ``lnmonitor/log10_transmission/<norm>``     span decades: read them on this scale)
    ``lnmonitor/share_median/<norm>``           median dead-plane share ``|P w| / |w|`` (0..1)
    ``lnmonitor/share_p90/<norm>``              its 90th percentile
    ``lnmonitor/share_max/<norm>``              its exact maximum
    ``lnmonitor/skipped_rows/<norm>``           rows without a share (zero or non-finite
                                                gradient or input, constant row), count
    ``lnmonitor/share_baseline/median``         median share of a random direction for this
                                                width and dead-subspace dimension
    ``lnmonitor/share_baseline/max``            median of the max of as many random rows as
                                                were measured (compare with ``share_max``)
    ``lnmonitor/ladder/attenuation``            ``inv_sigma(first rung) / inv_sigma(last rung)``
    ``lnmonitor/ladder/growth``                 ``rms(last rung) / rms(first rung)``
    ``lnmonitor/ladder_position/<norm>``        the norm's place among the rungs in forward
                                                order (0 first), -1 for a norm that is not a
                                                rung; logged once, at the first measured step
    ==========================================  ==============================================

    With ``images=True`` it also logs the pictures ``lnmonitor/ladder`` (at measured steps
    ``image_every_n_steps`` apart, and the last) and ``lnmonitor/ladder_over_training`` (at
    the end of the fit).

    When the selected norms differ in width or kind, the baselines are logged per norm
    as ``lnmonitor/share_baseline/median/<norm>`` and ``.../max/<norm>``.  With a
    TensorBoard logger: a custom-scalars layout (the whole ladder, the shares against
    their baselines, each as one multi-line chart), the norm kind, eps and width in the
    HPARAMS tab, and with ``histograms=True`` ``lnmonitor/hist/share/<norm>`` and
    ``lnmonitor/hist/sigma/<norm>``.

    What real training throws at it (the README's "Tested conditions"):

    * autocast (bf16, fp16 with a GradScaler): rows are reduced in float32; the share is
      a ratio, so the loss scale cancels; rows whose gradient or input is zero or not
      finite (an fp16 overflow, a NaN) are skipped and counted in ``skipped_rows``;
    * gradient accumulation: one measured step covers all its micro-batches;
    * ``torch.compile``: compiled code does not run hooks registered after it compiled, so
      the measured steps run eagerly (``torch.compiler.set_stance("force_eager")``, said
      once when the fit starts) and the others run the compiled code;
    * activation checkpointing: every norm call is measured once (see
      :mod:`lnmonitor.taps`);
    * a selected norm that gets no row in a measured step (never called, or hidden from
      the hooks) is named in a warning, once; nothing is made up for it.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        final_norm: str | None = None,
        histograms: bool = False,
        keep_history: bool | None = None,
        ladder: str | Sequence[str] | None = None,
        images: bool = True,
        image_every_n_steps: int = 50,
        summary: bool = True,
    ) -> None:
        self._every_arg = arguments.positive_int(every_n_steps, "every_n_steps")
        self.include = arguments.patterns(include, "include")
        self.exclude = arguments.patterns(exclude, "exclude")
        self.final_norm = arguments.module_name(final_norm, "final_norm", "model.lnf")
        self.ladder = arguments.patterns(ladder, "ladder")
        self.histograms = arguments.flag(histograms, "histograms")
        self.images = arguments.flag(images, "images")
        self.image_every_n_steps = arguments.positive_int(image_every_n_steps, "image_every_n_steps",
                                                          allow_none=False)
        self.summary = arguments.flag(summary, "summary")
        self._sink = MetricSink("LayerNormMonitor", arguments.optional_flag(keep_history, "keep_history"))
        self.every_n_steps: int | None = self._every_arg
        self.norms: list[NormInfo] = []
        self.order: list[str] = []
        self.last_summaries: list[NormSummary] = []
        self._tap: NormTap | None = None
        self._layout: Layout | None = None
        self._measuring: int | None = None
        self._stance = None
        self._roles_known = False
        self._last_step: int | None = None
        self._trail = Trail()  # rank zero's logged curves, for the end-of-fit summary
        self._last_picture: float = -math.inf  # the step of the last ladder picture

    @property
    def history(self) -> list[dict[str, float]]:
        """Every dict logged in the current fit, with its ``step`` (see ``keep_history``)."""
        return self._sink.history

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_steps=self._every_arg, include=self.include, exclude=self.exclude
        )

    # -- one fit ---------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._stop()
        self.norms, self.order, self.last_summaries = [], [], []
        self._tap, self._layout, self._roles_known = None, None, False
        self._trail = Trail(series=(f"{PREFIX}/inv_sigma/",))
        self._last_picture = -math.inf
        self.every_n_steps = self._every_arg or max(int(trainer.log_every_n_steps), 1)
        self._sink.setup(trainer, hparams=True)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After configure_model and the strategy's setup: the model is complete and sharded.
        self.norms = self._select(pl_module)
        self._tap = NormTap(self.norms)
        self._layout = Layout(len(self.norms))
        say_measured_eps("LayerNormMonitor", self.norms)
        self._sink.give_hparams(trainer, pl_module, *self._hparams(pl_module))
        last = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._last_step = int(last) - 1 if math.isfinite(last) else None
        if compiled(pl_module):
            rank_zero_info(
                "LayerNormMonitor: the model is compiled (torch.compile); its measured steps run "
                "eagerly (torch.compiler.set_stance('force_eager')) so that the norm hooks see "
                "every call, and the other steps run the compiled code."
            )

    def _select(self, pl_module: LightningModule) -> list[NormInfo]:
        discovery = discover_norms(pl_module)
        found = discovery.norms
        refused = refused_message("LayerNormMonitor", discovery.refused)
        if not found:
            detail = f" {refused}" if refused else ""
            raise MisconfigurationException(no_norm_message("LayerNormMonitor", pl_module) + detail)
        if refused:
            self._sink.warn_once("refused", refused)
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
            refusal = next((r for r in discovery.refused if r.name == self.final_norm), None)
            where = ("is excluded by include/exclude" if self.final_norm in names else
                     f"is not measured: {refusal.reason}" if refusal else "is not a norm")
            raise MisconfigurationException(
                f"LayerNormMonitor: final_norm={self.final_norm!r} {where}; the selected norms "
                f"are {', '.join(n.name for n in selected)}."
            )
        return selected

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()
        if not trainer.is_global_zero or not self._trail:
            return
        try:
            curves = self._trail.curves()
            rungs, steps, grid = ladder_grid(curves)
            if self.images and len(steps) > 1:
                picture = heatmap_picture([n.removeprefix("model.") for n in rungs], steps, grid,
                                          "1/sigma of each rung over training (forward order, top down)")
                self._sink.log_image(trainer, f"{PREFIX}/ladder_over_training", steps[-1], picture)
            if self.summary:
                rank_zero_info(summary_text(curves, f"{type(pl_module).__name__}, end of fit"))
        except Exception as err:  # noqa: BLE001 - the end-of-fit views must never fail a fit
            self._sink.warn_once("end", f"LayerNormMonitor: no end-of-fit summary/picture: {err!r}")

    def _stop(self) -> None:
        """End a measured step early (an exception, the end of the fit): no hook, no row left."""
        if self._tap is not None:
            self._tap.detach()
            self._tap.collect()
        self._measuring = None
        self._leave_eager()

    def _leave_eager(self) -> None:
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)

    # -- the measured step -----------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tap is None or self._measuring is not None:
            return
        step = trainer.global_step
        due = step % self.every_n_steps == 0 or step == self._last_step  # the last step, always
        if due and step > self._sink.last_step:
            self._measuring = step
            # compiled code ignores hooks registered after it compiled (and hooks present
            # while it compiles break its graph): the measured step runs eagerly
            self._stance = eager()
            self._stance.__enter__()
            self._tap.attach(bypass=not self._roles_known)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring is None or trainer.global_step == self._measuring:
            return  # not measuring, or still accumulating gradients for this step
        step, self._measuring = self._measuring, None
        self._tap.detach()
        self._leave_eager()
        rows = self._tap.collect()
        if self._tap.error is not None:  # a hook could not measure this model: say so, stop
            err, self._tap = self._tap.error, None
            self._sink.warn_once("off", (
                f"LayerNormMonitor is off for the rest of this run: measuring step {step} failed "
                f"inside a norm's hook ({type(err).__name__}: {err}); training goes on. If a norm "
                "computes something lnmonitor misreads, leave it out with exclude=[...]."))
            return
        if rows.order:
            self.order = [self.norms[i].name for i in rows.order]
        flat = summarise(rows, self._layout, pl_module.device)
        if trainer.world_size > 1:
            flat = trainer.strategy.all_gather(flat)
        summaries = read(merge(flat, self._layout), self._layout, counts=self.histograms)
        eps = {i: rows.eps.get(i, info.eps()) for i, info in enumerate(self.norms)}
        self.last_summaries = summaries
        if not self._roles_known:
            self._assign_roles(summaries)
        self._warn_unmeasured(step, summaries)
        metrics = finite(self._metrics(summaries, eps))
        if self._sink.last_step < 0:
            self._sink.add_layout(self._layout_categories())
            metrics.update(self._ladder_positions())
        logged = self._sink.log(
            trainer, step, metrics,
            (lambda writer, s: self._histograms(writer, s, summaries, eps)) if self.histograms else None,
        )
        if logged and trainer.is_global_zero:
            self._trail.add(step, metrics)
            spaced = step - self._last_picture >= self.image_every_n_steps or step == self._last_step
            if self.images and spaced:
                self._log_picture(trainer, step, metrics)
                self._last_picture = step

    def _rungs(self) -> list[str]:
        """The rungs' names in forward order."""
        role = {info.name: info.role for info in self.norms}
        return [name for name in self.order if role.get(name) in RUNGS]

    def _ladder_positions(self) -> dict[str, float]:
        """``lnmonitor/ladder_position/<norm>``: each rung's place in forward order, -1 for the
        norms that are not rungs (logged once, so a summary read back knows the ladder)."""
        place = {name: float(i) for i, name in enumerate(self._rungs())}
        return {per_norm("ladder_position", info.name): place.get(info.name, -1.0) for info in self.norms}

    def _log_picture(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """The ladder at this step as a picture: 1/sigma and rms of every rung against depth."""
        rungs = self._rungs()
        final = next((n.name for n in self.norms if n.role == FINAL), None)
        attenuation = metrics.get(f"{PREFIX}/ladder/attenuation")
        title = f"step {step}" + (f": attenuation {attenuation:.2f}x" if attenuation else "")
        picture = ladder_picture(
            [n.removeprefix("model.") for n in rungs],
            [metrics.get(per_norm("inv_sigma", n), math.nan) for n in rungs],
            [metrics.get(per_norm("rms", n), math.nan) for n in rungs],
            final.removeprefix("model.") if final else None, title,
        )
        self._sink.log_image(trainer, f"{PREFIX}/ladder", step, picture)

    def _warn_unmeasured(self, step: int, summaries: list[NormSummary]) -> None:
        """Say once when selected norms had no row in a measured step (never zero data
        without a word): a norm the forward does not call, or a model run by code the hooks
        cannot see (e.g. torch.compile on a torch without set_stance, TorchScript)."""
        missing = [info.name for info, s in zip(self.norms, summaries, strict=True) if s.rows == 0]
        if not missing:
            return
        if len(missing) == len(self.norms):
            what = f"none of the {len(missing)} selected norms ran with gradient"
        else:
            what = f"{len(missing)} of the {len(self.norms)} selected norms did not run with gradient"
        self._sink.warn_once(
            "unmeasured",
            f"LayerNormMonitor: {what} during the measured step {step} ({', '.join(missing[:8])}"
            f"{', ...' if len(missing) > 8 else ''}), so nothing is logged for them. Either the "
            "forward does not call these modules (leave them out with exclude=[...]) or it runs "
            "code the module hooks cannot see (torch.compile without torch.compiler.set_stance, "
            "TorchScript). Said once.",
        )

    def _assign_roles(self, summaries: list[NormSummary]) -> None:
        """Which norms are rungs, from what this step's gradient does at each norm's input."""
        by_name = {n.name: n for n in self.norms}
        ordered = [by_name[n] for n in self.order if n in by_name]
        ordered += [n for n in self.norms if n.name not in self.order]
        bypass = {info.name: s.bypass for info, s in zip(self.norms, summaries, strict=True)}
        roles = {n.name: n.role for n in assign_roles(ordered, bypass, self.ladder, self.final_norm)}
        self.norms = [info.with_role(roles[info.name]) for info in self.norms]
        self._roles_known = True
        rungs = [n for n in ordered if roles[n.name] in RUNGS]
        others = [n for n in ordered if roles[n.name] not in RUNGS]
        final = next((n.name for n in ordered if roles[n.name] == FINAL), None)
        said = (f"LayerNormMonitor: the ladder has {len(rungs)} rungs, the norms that read the residual "
                f"stream ({rungs[0].name if rungs else '-'} ... {rungs[-1].name if rungs else '-'}), "
                f"final norm {final or 'none'}")
        if others:
            groups = sorted({roles[n.name] for n in others})
            said += (f"; {len(others)} norms of other roles ({', '.join(groups)}: "
                     f"{', '.join(n.name for n in others[:3])}{', ...' if len(others) > 3 else ''}) "
                     "are measured but are not rungs")
        rank_zero_info(said + (" (as ladder=... says)." if self.ladder else
                               "; ladder=[...] names the rungs instead."))
        if len(rungs) < 2:
            self._sink.warn_once("one-rung", (
                f"LayerNormMonitor: the ladder has {len(rungs)} rung(s), so no attenuation or growth "
                "is logged: only these norms read the residual stream. Name the rungs with "
                "ladder=[...] if they are others."))

    def _metrics(self, summaries: list[NormSummary], eps: dict[int, float]) -> dict[str, float]:
        m: dict[str, float] = {}
        inv_sigma, rms = {}, {}
        for i, (info, s) in enumerate(zip(self.norms, summaries, strict=True)):
            n = info.name
            v = s.var_median
            sigma = math.sqrt(v + eps[i])
            inv_sigma[n], rms[n] = 1.0 / sigma, math.sqrt(s.ms_median)
            m[per_norm("sigma", n)] = sigma
            m[per_norm("inv_sigma", n)] = inv_sigma[n]
            m[per_norm("rms", n)] = rms[n]
            m[per_norm("eps_over_var", n)] = eps[i] / v if v > 0 else math.nan
            m[per_norm("transmission", n)] = eps[i] / (v + eps[i])
            # the same on a log scale, readable where the values span decades
            positive = v > 0 and eps[i] > 0
            m[per_norm("log10_eps_over_var", n)] = math.log10(eps[i] / v) if positive else math.nan
            m[per_norm("log10_transmission", n)] = math.log10(eps[i] / (v + eps[i])) if positive else math.nan
            m[per_norm("share_median", n)] = s.share_median
            m[per_norm("share_p90", n)] = s.share_p90
            m[per_norm("share_max", n)] = s.share_max
            m[per_norm("skipped_rows", n)] = float(s.skipped_rows)
        m.update(self._baselines(summaries))
        roles = {n.name: n.role for n in self.norms}
        order = [n for n in self.order if n in inv_sigma] or [n.name for n in self.norms]
        rungs = [n for n in order if roles.get(n) in RUNGS or roles.get(n) is None]
        final = next((n for n in rungs if roles.get(n) == FINAL), None)
        if len(rungs) >= 2:
            first, last = rungs[0], final or rungs[-1]
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
            out[f"{PREFIX}/share_baseline/median/{info.name}"] = _baseline_median(info.width, info.dead_dim)
            if s.share_rows >= 1:
                out[f"{PREFIX}/share_baseline/max/{info.name}"] = _baseline_max(
                    info.width, info.dead_dim, s.share_rows
                )
        return out

    def _hparams(self, pl_module: LightningModule) -> tuple[dict, list[str]]:
        norms = self.norms
        dtype = next((p.dtype for p in pl_module.parameters() if p.is_floating_point()), torch.float32)
        kinds = sorted({n.kind for n in norms})
        epss = sorted({n.eps(dtype) for n in norms})
        widths = sorted({n.width for n in norms if n.width is not None})
        params = {
            f"{PREFIX}/norm_kind": ",".join(kinds),
            f"{PREFIX}/eps": epss[0] if len(epss) == 1 else ",".join(f"{e:g}" for e in epss),
            f"{PREFIX}/width": widths[0] if len(widths) == 1 else ",".join(map(str, widths)),
            f"{PREFIX}/n_norms": len(norms),
            f"{PREFIX}/every_n_steps": self.every_n_steps,
        }
        last = self.final_norm or norms[-1].name
        metrics = [f"{PREFIX}/ladder/attenuation", per_norm("log10_eps_over_var", last),
                   per_norm("share_median", last), f"{PREFIX}/ladder/growth"]
        return params, metrics

    # -- TensorBoard extras ----------------------------------------------------------

    def _layout_categories(self) -> dict[str, dict]:
        """Charts by regex over the metric names, so every run's layout is the same and
        TensorBoard shows one chart per title for a logdir of several runs."""
        p = PREFIX
        return {
            "lnmonitor: 1/sigma ladder": {
                "1/sigma by norm": ["Multiline", [f"{p}/inv_sigma/.*"]],
                "rms of the stream each norm reads": ["Multiline", [f"{p}/rms/.*"]],
                "log10 eps/var by norm": ["Multiline", [f"{p}/log10_eps_over_var/.*"]],
                "log10 transmission eps/(var+eps) by norm": ["Multiline", [f"{p}/log10_transmission/.*"]],
                "ladder attenuation and growth": ["Multiline", [f"{p}/ladder/.*"]],
            },
            "lnmonitor: dead-plane share": {
                "median share vs random median": [
                    "Multiline", [f"{p}/share_median/.*", f"{p}/share_baseline/median.*"]],
                "p90 share": ["Multiline", [f"{p}/share_p90/.*"]],
                "max share vs random max": ["Multiline", [f"{p}/share_max/.*", f"{p}/share_baseline/max.*"]],
                "skipped rows": ["Multiline", [f"{p}/skipped_rows/.*"]],
            },
        }

    def _histograms(self, writer, step: int, summaries: list[NormSummary], eps: dict[int, float]) -> None:
        for i, (info, s) in enumerate(zip(self.norms, summaries, strict=True)):
            write_histogram(writer, f"{PREFIX}/hist/share/{info.name}", step,
                            s.share_counts, s.layout.share_edges(), group=64)
            sigma_edges = np.sqrt(s.layout.value_edges() + eps[i])
            write_histogram(writer, f"{PREFIX}/hist/sigma/{info.name}", step,  # 1/8 octave buckets
                            s.var_counts, sigma_edges, group=16)

    # -- checkpointing ---------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "last_logged_step": self._sink.last_step,
            "every_n_steps": self.every_n_steps,
            "order": list(self.order),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._sink.last_step = int(state_dict.get("last_logged_step", -1))
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
