"""The meter: one measured step, from the hooks to the figures.

:class:`LadderMeter` owns everything between a model and a step's figures, and knows nothing of who
drives it (a Lightning callback, a ``transformers.Trainer`` callback or a plain loop)::

    meter = LadderMeter(model)            # discovery, self-check: once
    with meter.step():                    # hooks on for this step only
        loss = model(**batch).loss
        loss.backward()
    result = meter.result()               # LadderResult: statistics, roles, figures, metrics()

Every forward and backward with gradient between :meth:`~LadderMeter.start` and
:meth:`~LadderMeter.stop` is one measured step (a step's micro-batches too); padding rows are in no
statistic.  ``stop()`` leaves the step vector on the device; :meth:`~LadderMeter.result` merges it
over processes, reads it on the host once, assigns the roles on the first step and computes every
figure (:func:`norm_figures`, :func:`ladder_figures`: the one definition of each).  The meter
never raises into training: a hook that cannot measure the model turns it off
(:attr:`LadderMeter.off_reason`, said once); its words are :mod:`lnmonitor.core.meter.messages`.

The path of one number, a norm's dead-plane share median, from the hook to the logger
(docs/layout.md lists it name by name; a test resolves every name)::

    taps.NormTap -> reductions.row_raw       each call's raw rows, on the device (taps.RawCall)
      -> reductions.finish_rows -> StepRows  the step's rows, finished together
    row_stats.histogram_rows                 each row's share (reductions.row_values), binned into
                                             the step vector of every norm's histograms
      -> merge_processes -> read             merged over processes; brought to the host once
      -> hist_quantiles -> RowStats          the median read from its histogram
    meter.norm_figures -> NormFigures -> LadderFigures -> LadderResult
      -> finite_metrics -> dict[str, float]  the finite metrics, by their logged names
    monitor.Monitor.log -> lightning.loggers.Loggers.log   (a TensorBoard logger's through
                                             output.writers.write_scalars; the plain loop's and the
                                             Trainer's monitors end at their own writers instead)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor, nn

from lnmonitor.core.hooks import Hooks, eager, measuring
from lnmonitor.core.kinds import NormKind
from lnmonitor.core.maths import geometry, random_baseline
from lnmonitor.core.meter import messages
from lnmonitor.core.meter.growth_watch import GrowthWatch
from lnmonitor.core.meter.messages import Roles
from lnmonitor.core.meter.padding import RowMasks
from lnmonitor.core.meter.processes import StepMaximum, several_processes
from lnmonitor.core.meter.row_stats import (
    Layout,
    RowStats,
    count_targets,
    histogram_rows,
    merge_processes,
    read,
)
from lnmonitor.core.meter.taps import NormTap
from lnmonitor.core.monitor.shared import Messages, off_message
from lnmonitor.core.norms.discovery import NormSelectionError, choose_norms, measured_eps_message
from lnmonitor.core.norms.find import NormInfo
from lnmonitor.core.norms.roles import FINAL, POST, RUNG_BYPASS_TOLERANCE, RUNGS, assign_roles, stack_of
from lnmonitor.core.output.metric_names import baseline_metric, ladder_metric, per_norm
from lnmonitor.core.wrappers import compiled, unknown_wrapper, unwrap

__all__ = [
    "Ladder", "LadderFigures", "LadderMeter", "LadderResult", "NormFigures", "baseline_max",
    "baseline_median", "finite_metrics", "ladder_figures", "norm_figures",
]


class LadderMeter:
    """Measure the norms of ``model`` (or of the model inside the wrapper the user calls: Fabric's,
    DDP, ``torch.compile``, FSDP1) on the steps you choose.  ``include``, ``exclude``,
    ``final_norm``, ``ladder`` and ``row_mask`` are :class:`~lnmonitor.Settings`' fields (``row_mask``
    reads what :meth:`use_batch` was given, or the model's keyword inputs); ``name`` starts the
    messages; ``info(message)`` and ``warn(key, message)`` (once per key) say them;
    ``watch_growth``: take the ladder's growth on every training step (:meth:`take_growth`).

    Raises:
        NormSelectionError: no normalisation layer, the patterns select none, ``final_norm`` is
            not a selected norm, or a norm is too narrow for its dead subspace.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        final_norm: str | None = None,
        ladder: str | Sequence[str] | None = None,
        row_mask: Callable | bool | None = None,
        name: str = "LadderMeter",
        info: Callable[[str], None] | None = None,
        warn: Callable[[str, str], None] | None = None,
        watch_growth: bool = True,
    ) -> None:
        self.name = name
        self.final_norm = final_norm
        self.ladder = ladder
        default = Messages()
        self._info = info or default.info
        self._warn = warn or default.warn
        self.model = unwrap(model)  # names and inputs are the user's model's, whatever wraps it
        self.norms = choose_norms(model, include, exclude, final_norm, name, self._warn)
        wrapper = unknown_wrapper(self.model)
        if wrapper:
            self._warn("wrapper", (
                f"{name}: {type(self.model).__name__} looks like a wrapper lnmonitor does not know "
                f"({wrapper} holds the model): every norm's name starts with it. Pass the model inside it "
                "to keep the "
                "names the same whatever wraps the model. Said once."))
        for norm in self.norms:
            if norm.width is not None and norm.width <= norm.dead_dim:
                raise NormSelectionError(messages.narrow_message(name, norm.name, norm.width, norm.dead_dim,
                                                                 norm.kind))
        self._names = [norm.name for norm in self.norms]
        self.layout = Layout(len(self.norms))
        self.order: list[str] = []
        self.roles_known = False
        self.off_reason: str | None = None
        self._tap = NormTap(self.norms)
        self._eager_code = None
        self._pending: Tensor | None = None
        self._eps: dict[int, float] = {}
        self._resolution: dict[int, float] = {}
        self._forward_only: set[int] = set()
        self._unmasked: set[int] = set()  # norms whose rows the step's padding mask did not fit
        self._ran_forward = False
        self._said_zero_grad = False  # rows without gradient where there is no target: said once
        self.reused: set[str] = set()  # norms the forward calls more often than others: no rung
        # {norm: stack} (its residual stream), and the stack of the model's ladder: known with the roles
        self.stack_of: dict[str, str] = {}
        self.main_stack = ""
        # an encoder-decoder's decoder norms: their padding is the batch's decoder_attention_mask
        named = stack_of([n.name for n in self.norms])
        decoder = {i for i, n in enumerate(self.norms) if named[n.name].rsplit(".", 1)[-1] == "decoder"}
        self._rows = RowMasks(row_mask, decoder, len(self.norms), lambda: _device(model), name, self._warn)
        self._inputs_hooks = Hooks()  # the model's keyword inputs, for their padding mask
        self.refused: dict[str, str] = {}  # norms whose DTensor layout the taps cannot read, and why
        self._watch = GrowthWatch()  # the ladder's growth on every step, once the roles are known
        self._across: StepMaximum | None = None  # of several processes: its maximum over them
        self.watch_growth = watch_growth
        said = measured_eps_message(name, self.norms)
        if said:
            self._info(said)
        if compiled(model):
            self._info(messages.compiled_message(name))

    # -- one measured step -------------------------------------------------------------

    @property
    def measuring(self) -> bool:
        return self._eager_code is not None

    def start(self) -> None:
        """Hook the norms until :meth:`stop` (a no-op while measuring or when off)."""
        if self.off_reason is not None or self.measuring:
            return
        # compiled code ignores hooks registered after it compiled (and hooks present while
        # it compiles break its graph): the measured step runs eagerly
        self._eager_code = eager()
        self._eager_code.__enter__()
        self._tap.row_mask = None
        self._tap.attach(bypass=not self.roles_known)
        if self._rows.row_mask is not False:
            self._inputs_hooks.forward_pre(self.model, self._on_inputs, with_kwargs=True)

    def use_batch(self, batch) -> None:
        """The (micro-)batch about to run: its padding rows are left out (see ``row_mask``)."""
        if self.measuring and self._rows.row_mask is not False:
            self._tap.row_mask = self._rows(batch)

    def _on_inputs(self, module, args, kwargs) -> None:
        """The model's keyword inputs: their padding mask is used (not a probe's forward's)."""
        if not (kwargs and measuring() and torch.is_grad_enabled()):
            return
        keep = self._rows(kwargs)
        if keep is not None:
            self._tap.row_mask = keep

    def stop(self) -> None:
        """Unhook, and leave the step's histograms on the device for :meth:`result`."""
        if not self.measuring:
            return
        self._unhook()
        rows = self._tap.collect()
        if self._tap.error is not None:  # a hook could not measure this model: say so, stop
            self.off_reason = messages.off_reason(self._tap.error)
            self._warn("off", off_message(self.name, self.off_reason))
            self._pending = None
            return
        if rows.order:
            self.order = [self.norms[i].name for i in rows.order]
        self._eps, self._resolution, self._forward_only = rows.eps, rows.resolution, rows.forward_only
        self._unmasked = rows.unmasked
        self._ran_forward = bool(rows.order)
        if rows.calls and not self.roles_known:
            fewest = min(rows.calls.values())
            self.reused = {self.norms[i].name for i, c in rows.calls.items() if c > fewest}
        self._refuse(rows.refused)
        self._pending = histogram_rows(rows, self.layout, _device(self.model), several_processes())

    def abort(self) -> None:
        """End a measured step early (an exception, the end of training): no hook, no row left."""
        if self.measuring:
            self._unhook()
        self._tap.collect()
        self._pending = None

    def close(self) -> None:
        """The end of training: :meth:`abort`, and the every-step growth's hooks removed."""
        self.abort()
        self._watch.detach()
        if self._across is not None:
            self._across.finish()

    def take_growth(self, step: int) -> tuple[int, float] | None:
        """Close optimizer step ``step`` for the every-step growth: ``(step, growth)`` of the latest
        step whose value reached the host, or None.  Of several processes, every one must call this
        every step: the growth is the largest over them (on a GPU read a step later)."""
        if self._across is not None:
            return self._take_across(step)
        if self.off_reason is not None:
            self._watch.detach()
            return None
        taken = self._watch.take(step)
        self._say_watch_error()
        return taken

    def _take_across(self, step: int) -> tuple[int, float] | None:
        """:meth:`take_growth` of one of several processes: when one can no longer watch, all stop."""
        stop = self.off_reason is not None or self._watch.error is not None
        value = None if stop else self._watch.close()
        taken = self._across.close(step, value, stop, _device(self.model))
        if self._across.stopped:
            self._watch.detach()
            self._say_watch_error()
        return taken

    def _say_watch_error(self) -> None:
        error = self._watch.error
        if error is not None:
            self._warn("growth-watch", f"{self.name}: the every-step growth stopped: its hook could not "
                                       f"read the stream ({type(error).__name__}: {error}); the findings "
                                       "read the growth on measured steps from here.")

    def _unhook(self) -> None:
        self._tap.detach()
        self._tap.row_mask = None
        self._inputs_hooks.remove()
        eager_code, self._eager_code = self._eager_code, None
        eager_code.__exit__(None, None, None)

    @contextlib.contextmanager
    def step(self) -> Iterator[LadderMeter]:
        """Measure the forward and backward passes run inside the block."""
        self.start()
        try:
            yield self
        except BaseException:
            self.abort()
            raise
        self.stop()

    # -- the numbers -------------------------------------------------------------------

    def result(self, merge: bool = False, *, counts: bool = False,
               label: str = "the measured step") -> LadderResult | None:
        """The last measured step's numbers, or None (off, or not measured).  The first call
        decides the roles from the merged rows and hooks the every-step growth.  ``merge``: over
        every process of the default group (all must call together); ``counts``: keep the
        histograms; ``label`` names the step in messages."""
        flat, self._pending = self._pending, None
        if flat is None:
            return None
        flat = merge_processes(flat, self.layout) if merge else flat[: self.layout.max_end]
        row_stats = read(flat, self.layout, counts=counts)
        if not self.roles_known:
            self._assign_roles(row_stats)
            self._watch_ladder()
        unmeasured = [info.name for info, s in zip(self.norms, row_stats, strict=True)
                      if s.rows == 0 and info.name not in self.refused]
        if len(unmeasured) == len(self.norms) and self._ran_forward:
            self._info(messages.no_backward_message(self.name, label))
            return None
        if unmeasured:
            said = messages.unmeasured_message(self.name, label, unmeasured, len(self.norms))
            self._warn("unmeasured", said)
            if len(unmeasured) == len(self.norms):
                return None
        # one ladder per stack (an encoder-decoder's encoder and decoder), the model's apart
        stack_of_norm = {n.name: self.stack_of.get(n.name, self.main_stack) for n in self.norms}
        finals = {stack_of_norm[n.name]: n.name for n in self.norms if n.role == FINAL}
        index = {n.name: i for i, n in enumerate(self.norms)}
        final_of = [index.get(finals.get(stack_of_norm[n.name])) for n in self.norms]
        row_stats = count_targets(row_stats, final_of, self._forward_only)
        self._say_conditions(row_stats)
        norms = [norm_figures(info.name, info.kind, info.width, self.eps(i), s)
                 for i, (info, s) in enumerate(zip(self.norms, row_stats, strict=True))]
        ladders: dict[str, list[str]] = {}
        for name in self.rungs():
            ladders.setdefault(stack_of_norm[name], []).append(name)
        rungs = ladders.pop(self.main_stack, [])
        others = {stack: (names, finals.get(stack)) for stack, names in ladders.items()}
        figures = ladder_figures(norms, rungs, finals.get(self.main_stack), others)
        return LadderResult(self.norms, row_stats, figures)

    def _refuse(self, refused: dict[int, str]) -> None:
        """Say once which norms have a layout whose rows cannot be read (the others are measured)."""
        named = {self.norms[i].name: why for i, why in refused.items()}
        new = {name: why for name, why in named.items() if name not in self.refused}
        if not new:
            return
        self.refused.update(new)
        self._warn(f"layout:{','.join(sorted(new))}", messages.layout_message(self.name, new))

    def _say_conditions(self, row_stats: list[RowStats]) -> None:
        """Say once what this step's conditions did: padding left out, norms without gradient."""
        if any(s.pad_rows for s in row_stats):
            self._warn("padding", messages.padding_message(self.name, self._rows.source))
        vanished = [(info.name, int(s.vanished_grad_rows), s.rows - s.pad_rows)
                    for info, s in zip(self.norms, row_stats, strict=True) if s.vanished_grad_rows > 0]
        zero = [(info.name, s.zero_grad_rows) for info, s in zip(self.norms, row_stats, strict=True)
                if s.zero_grad_rows]
        if zero and not self._said_zero_grad:
            self._said_zero_grad = True
            self._info(messages.zero_grad_message(self.name, zero))
        if vanished:
            self._warn("vanished", messages.vanished_grad_message(self.name, vanished))
        if self._unmasked:
            names = [self.norms[i].name for i in sorted(self._unmasked)]
            self._warn("unmasked", messages.unmasked_message(self.name, self._rows.source, names))
        if self._forward_only:
            names = [self.norms[i].name for i in sorted(self._forward_only)]
            self._warn("forward-only", messages.forward_only_message(self.name, names))

    def eps(self, index: int) -> float:
        """The eps norm ``index`` applied in the last measured step (its dtype's, when it has none)."""
        return self._eps.get(index, self.norms[index].eps())

    @property
    def final(self) -> str | None:
        """The final norm of the model's ladder (None before the roles are known, or none)."""
        if not self.roles_known:
            return None
        main = [n.name for n in self.norms if self.stack_of.get(n.name, self.main_stack) == self.main_stack]
        return next((n.name for n in self.norms if n.role == FINAL and n.name in main), None)

    def rungs(self) -> list[str]:
        """The rungs' names in forward order (all norms, in forward order, before roles are known)."""
        role = {info.name: info.role for info in self.norms}
        return [name for name in self.forward_order()
                if (role.get(name) in RUNGS or role.get(name) is None) and name not in self.reused
                and name not in self.refused]

    def forward_order(self) -> list[str]:
        """The norms' names in the order they ran, the rest after."""
        return [n for n in self.order if n in self._names] + [n for n in self._names if n not in self.order]

    def _assign_roles(self, row_stats: list[RowStats]) -> None:
        """Which norms are rungs, from what this step's gradient does at each norm's input."""
        by_name = {n.name: n for n in self.norms}
        ordered = [by_name[n] for n in self.forward_order()]
        bypass = {info.name: s.bypass for info, s in zip(self.norms, row_stats, strict=True)}
        # a low-precision gradient rounds: what goes around a norm is measured to about its
        # resolution (bfloat16: 2^-7), so a branch norm's rounding is not read as a residual path
        tolerance = {self.norms[i].name: max(RUNG_BYPASS_TOLERANCE, 8 * r)
                     for i, r in self._resolution.items()}
        found = assign_roles(ordered, bypass, self.ladder, self.final_norm, tolerance)
        roles = {n.name: n.role for n in found}
        self.norms = [info.with_role(roles[info.name]) for info in self.norms]
        self.roles_known = True
        if self.reused:
            self._warn("reused", messages.reused_message(self.name, sorted(self.reused)))
        self.stack_of = stack_of([n.name for n in ordered])
        ran = [n.name for n in ordered if n.name in self.order] or [n.name for n in ordered]
        self.main_stack = self.stack_of[self.final_norm if self.final_norm in self.stack_of else ran[-1]]
        decided = self._roles(ordered, roles)
        self._info(messages.roles_message(self.name, decided, bool(self.ladder)))
        short = messages.short_ladder_message(self.name, decided)
        if short:
            self._warn("one-rung", short)

    def _watch_ladder(self) -> None:
        """Hook the first and last rung of the model's ladder for the every-step growth."""
        rungs = [n for n in self.rungs() if self.stack_of.get(n, self.main_stack) == self.main_stack]
        if self.watch_growth and len(rungs) >= 2:
            modules = {info.name: info.module for info in self.norms}
            self._watch.attach(modules[rungs[0]], modules[rungs[-1]])
            self._across = StepMaximum() if several_processes() else None

    def _roles(self, ordered: list[NormInfo], roles: dict[str, str]) -> Roles:
        """The role decision by stack, stacks in forward order."""
        order = dict.fromkeys(self.stack_of[n.name] for n in ordered)
        ladders: dict[str, list[str]] = {stack: [] for stack in order}
        post: dict[str, list[str]] = {stack: [] for stack in order}
        finals: dict[str, str] = {}
        others: list[tuple[str, str]] = []
        for n in ordered:
            stack, role = self.stack_of[n.name], roles[n.name]
            if role in RUNGS and n.name not in self.reused and n.name not in self.refused:
                ladders[stack].append(n.name)
            if role not in RUNGS:
                others.append((n.name, role))
            if role == POST:
                post[stack].append(n.name)
            if role == FINAL:
                finals[stack] = n.name
        return Roles(ladders, finals, self.main_stack, others, post)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


# -- the figures: every figure reported about a step's norms ---------------------------


@dataclass(frozen=True)
class NormFigures:
    """One norm's figures in one step: ``sigma = sqrt(var + eps)`` (input units), ``inv_sigma``,
    ``rms = sqrt(ms)``, ``eps_over_var`` and ``transmission = eps / (var + eps)``, with ``var`` and
    ``ms`` the medians over rows of the input's variance (RMSNorm: mean square) and mean square;
    ``stats``: the rest (the shares' quantiles, the rows counted)."""

    name: str
    kind: NormKind
    width: int | None
    eps: float
    stats: RowStats
    sigma: float
    inv_sigma: float
    rms: float
    eps_over_var: float
    transmission: float


@dataclass(frozen=True)
class Ladder:
    """The ladder of another stack (an encoder-decoder's encoder), as in :class:`LadderFigures`."""

    stack: str
    rungs: list[str]
    final: str | None
    attenuation: float
    growth: float


@dataclass(frozen=True)
class LadderFigures:
    """Every norm's figures, the model's ladder (rungs in forward order, the final norm last),
    ``attenuation = inv_sigma(first rung) / inv_sigma(last rung)``, ``growth = rms(last rung) /
    rms(first rung)`` (nan below two rungs), the shares' random baselines, and the other stacks'
    ladders."""

    norms: list[NormFigures]
    rungs: list[str]
    final: str | None
    attenuation: float
    growth: float
    baselines: dict[str, float]
    other_ladders: tuple[Ladder, ...] = ()

    def by_name(self) -> dict[str, NormFigures]:
        return {f.name: f for f in self.norms}

    def baseline(self, name: str) -> tuple[float, float]:
        """``(median, max)`` random baselines of norm ``name``'s shares (nan where none)."""
        pair = []
        for which in ("median", "max"):
            shared = self.baselines.get(baseline_metric(which), math.nan)
            pair.append(self.baselines.get(baseline_metric(which, name), shared))
        return pair[0], pair[1]

    @property
    def main(self) -> Ladder:
        """The model's ladder as a :class:`Ladder` (its ``stack`` is ``""``)."""
        return Ladder("", self.rungs, self.final, self.attenuation, self.growth)

    def metrics(self) -> dict[str, float]:
        """The figures under their logged names, nan included."""
        m: dict[str, float] = {}
        for f in self.norms:
            s, n = f.stats, f.name
            positive = s.var_median > 0 and f.eps > 0
            m[per_norm("sigma", n)] = f.sigma
            m[per_norm("inv_sigma", n)] = f.inv_sigma
            m[per_norm("rms", n)] = f.rms
            m[per_norm("eps_over_var", n)] = f.eps_over_var
            m[per_norm("transmission", n)] = f.transmission
            # the same on a log scale, readable where the values span decades
            m[per_norm("log10_eps_over_var", n)] = math.log10(f.eps_over_var) if positive else math.nan
            m[per_norm("log10_transmission", n)] = math.log10(f.transmission) if positive else math.nan
            m[per_norm("share_median", n)] = s.share_median
            m[per_norm("share_p90", n)] = s.share_p90
            m[per_norm("share_max", n)] = s.share_max
            m[per_norm("skipped_rows", n)] = float(s.skipped_rows)
            m[per_norm("zero_grad_rows", n)] = float(s.zero_grad_rows)
            m[per_norm("vanished_grad_rows", n)] = s.vanished_grad_rows
        m.update(self.baselines)
        for ladder in (self.main, *self.other_ladders):
            if len(ladder.rungs) >= 2:
                m[ladder_metric("attenuation", ladder.stack)] = ladder.attenuation
                m[ladder_metric("growth", ladder.stack)] = ladder.growth
        return m

    def positions(self) -> dict[str, float]:
        """``lnmonitor/ladder_position/<norm>``: each rung's place (0 first; other stacks' rungs
        first), -1 for the other norms."""
        rungs = [name for ladder in (*self.other_ladders, self) for name in ladder.rungs]
        place = {name: float(i) for i, name in enumerate(rungs)}
        return {per_norm("ladder_position", f.name): place.get(f.name, -1.0) for f in self.norms}


@dataclass
class LadderResult:
    """One measured step: each norm (with its role), its row statistics and the figures."""

    norms: list[NormInfo]
    row_stats: list[RowStats]
    figures: LadderFigures

    def metrics(self, positions: bool = False) -> dict[str, float]:
        """The finite figures under their logged names; ``positions`` adds each norm's
        ``ladder_position`` (logged once per run, at its first measured step)."""
        m = self.figures.metrics()
        if positions:
            m.update(self.figures.positions())
        return finite_metrics(m)


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The entries of ``metrics`` that are finite numbers (a monitor logs nothing it cannot
    stand behind; the missing ones are explained where they are computed)."""
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}


def norm_figures(name: str, kind: NormKind, width: int | None, eps: float, stats: RowStats) -> NormFigures:
    """The figures of norm ``name`` from its statistics."""
    var, ms = stats.var_median, stats.ms_median
    sigma = math.sqrt(var + eps) if var + eps >= 0 else math.nan
    return NormFigures(
        name=name, kind=kind, width=width, eps=eps, stats=stats,
        sigma=sigma,
        inv_sigma=1.0 / sigma if sigma > 0 else math.nan,
        rms=math.sqrt(ms) if ms >= 0 else math.nan,
        eps_over_var=eps / var if var > 0 else math.nan,
        transmission=geometry.transmission(var, eps) if var + eps > 0 else math.nan,
    )


def ladder_figures(
    figures: Sequence[NormFigures], rungs: Sequence[str], final: str | None = None,
    other_ladders: Mapping[str, tuple[Sequence[str], str | None]] | None = None,
) -> LadderFigures:
    """The ladder of ``figures`` over ``rungs`` (forward order; ``final`` ends it), and the other
    stacks' ``{stack: (rungs, final)}``.  A rung not measured this step makes the attenuation and
    growth nan: they are taken between the ladder's ends alone."""
    figures = list(figures)
    by_name = {f.name: f for f in figures}
    main = _ladder(by_name, "", rungs, final)
    others = tuple(_ladder(by_name, stack, r, f) for stack, (r, f) in (other_ladders or {}).items())
    return LadderFigures(figures, main.rungs, main.final, main.attenuation, main.growth,
                         _baselines(figures), others)


def _ladder(by_name: Mapping[str, NormFigures], stack: str, rungs: Sequence[str],
            final: str | None) -> Ladder:
    ladder = [n for n in rungs if n in by_name]
    if final in ladder:
        ladder = [n for n in ladder if n != final] + [final]
    attenuation = growth = math.nan
    if len(ladder) >= 2:
        first, last = by_name[ladder[0]], by_name[ladder[-1]]
        attenuation = first.inv_sigma / last.inv_sigma
        growth = last.rms / first.rms if first.rms > 0 else math.nan
    return Ladder(stack, ladder, final if final in ladder else None, attenuation, growth)


def _baselines(figures: Sequence[NormFigures]) -> dict[str, float]:
    """One pair of baselines, or one per norm when their widths or kinds differ."""
    shapes = {(f.width, geometry.dead_dim(f.kind)) for f in figures}
    out: dict[str, float] = {}
    if len(shapes) == 1:
        d, k = next(iter(shapes))
        if d is None or d <= k:
            return out
        out[baseline_metric("median")] = baseline_median(d, k)
        n = max(f.stats.share_rows for f in figures)
        if n >= 1:
            out[baseline_metric("max")] = baseline_max(d, k, n)
        return out
    for f in figures:
        k = geometry.dead_dim(f.kind)
        if f.width is None or f.width <= k:
            continue
        out[baseline_metric("median", f.name)] = baseline_median(f.width, k)
        if f.stats.share_rows >= 1:
            out[baseline_metric("max", f.name)] = baseline_max(f.width, k, f.stats.share_rows)
    return out


@lru_cache(maxsize=256)
def baseline_median(d: int, k: int) -> float:
    """Median dead-plane share of a random direction in ``d`` dimensions, ``k``-dim dead subspace."""
    return float(random_baseline.share_median(d, k))


@lru_cache(maxsize=4096)
def baseline_max(d: int, k: int, n: int) -> float:
    """Median of the maximum share of ``n`` random directions (compare with a measured max)."""
    return float(random_baseline.max_share_median(d, k, n))
