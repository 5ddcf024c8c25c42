"""What a fit's start costs on a large model: discovery, the float64 self-check, the roles.

A deep, narrow ``transformers`` Llama (random weights, nothing downloaded: 80 layers of two
RMSNorms and the final one, 161 norms; 126 layers, 253 norms) is built afresh for every repeat
(the float64 check is cached per module), and each part of a fit's start is timed apart:

* ``LadderMeter(model)``: the constructor, and of it ``choose_norms`` (discovery: the
  ``named_modules()`` walk, and every candidate's float64 check against its own output);
* the first measured step (``start()``, forward and backward, ``stop()``, ``result()``: its hooks
  also measure what goes around each norm, and ``result()`` assigns the roles), as its extra time
  over the median plain step (forward and backward) of the same repeat; of it ``result()`` and of
  that ``_assign_roles``;
* a later measured step's extra (the median of ``--later`` of them, each between plain steps);
* the monitors' fit start: ``LoopMonitor(model, writer, probe_batch=...)``, its step 0 (its first
  invariance probe run with the probe's one-time checks, the first measured step, the roles, the
  first write) and, with Lightning, ``LayerNormMonitor``'s ``setup`` and ``on_fit_start`` (the
  meter and the HPARAMS session) called on a real ``Trainer`` with a TensorBoard logger.

Each figure is the median and the minimum over ``--repeats`` repeats (one torch thread by default),
with the steps' ratios to the plain step, and the first repeat of the process (its imports too).
``--clock cpu`` times the process's CPU time instead of the wall clock: on a shared machine other
tenants stretch the wall clock by tens of percent from one repeat to the next, the CPU time less.
The last line says whether the constructors, the first step's extra and the roles took under a
second (medians), or names those that did not.

    python benchmarks/fit_start.py --layers 80 126 --repeats 7 [--clock cpu]
    python benchmarks/fit_start.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

import lnmonitor.core.meter.meter as meter_module
from lnmonitor.core.meter.meter import LadderMeter

BUDGET_S = 1.0  # the goal for each part of a fit's start on a model of 160+ norms
# the clock every part is timed with: wall time, or (--clock cpu) this process's CPU time, which
# other tenants' load on a shared machine does not stretch (with one torch thread, the same work)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = [time.perf_counter]


def llama(layers: int, hidden: int, heads: int, intermediate: int, vocab: int, seed: int = 0):
    """A ``LlamaForCausalLM`` of random weights: ``2 * layers + 1`` RMSNorms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=256)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # a full collection that building the model (thousands of objects) has made due is not the
    # monitor's: without this one, it lands on whichever part allocates next (~0.23 s at 126 layers)
    gc.collect()
    return model


class Timers:
    """Seconds spent in wrapped functions since the last :meth:`reset`, by name."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def reset(self) -> None:
        self.spent = {}

    def wrap(self, target, attribute: str, name: str) -> Callable[[], None]:
        """Time ``target.attribute`` under ``name``; returns what puts it back."""
        inner = target.__dict__[attribute] if isinstance(target, type) else getattr(target, attribute)

        def timed(*args, **kwargs):
            t0 = CLOCK[0]()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + CLOCK[0]() - t0

        setattr(target, attribute, timed)
        return lambda: setattr(target, attribute, inner)


TIMERS = Timers()


def _plain_step(model, batch) -> float:
    t0 = CLOCK[0]()
    model(**batch).loss.backward()
    seconds = CLOCK[0]() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def _measured_step(model, batch, meter: LadderMeter) -> tuple[float, float]:
    """(seconds of the whole measured step, of which ``result()``)."""
    t0 = CLOCK[0]()
    meter.start()
    model(**batch).loss.backward()
    meter.stop()
    t1 = CLOCK[0]()
    result = meter.result()
    t2 = CLOCK[0]()
    model.zero_grad(set_to_none=True)
    if result is None or meter.off_reason:
        raise SystemExit(f"the meter measured nothing: {meter.off_reason}")
    return t2 - t0, t2 - t1


def meter_repeat(build: Callable, batch: dict, later: int) -> dict[str, float]:
    """One repeat on a fresh model: the constructor, the first and later measured steps."""
    model = build()
    _plain_step(model, batch)  # the model's own first-call costs are not the meter's
    plain = [_plain_step(model, batch)]
    TIMERS.reset()
    t0 = CLOCK[0]()
    meter = LadderMeter(model, info=lambda _: None, warn=lambda *_: None)
    ctor = CLOCK[0]() - t0
    discovery = TIMERS.spent.get("choose_norms", 0.0)
    TIMERS.reset()
    first, first_result = _measured_step(model, batch, meter)
    roles = TIMERS.spent.get("_assign_roles", 0.0)
    steps = []
    for _ in range(later):
        plain.append(_plain_step(model, batch))
        steps.append(_measured_step(model, batch, meter)[0])
    plain.append(_plain_step(model, batch))
    meter.close()
    step = statistics.median(plain)
    return {"norms": len(meter.norms), "plain": step, "ctor": ctor, "discovery": discovery,
            "first_extra": first - step, "first_result": first_result, "roles": roles,
            "later_extra": statistics.median(steps) - step}


def monitor_repeat(build: Callable, batch: dict, lightning: bool) -> dict[str, float]:
    """One repeat of the monitors' fit start, each on a fresh model."""
    from torch.utils.tensorboard import SummaryWriter

    from lnmonitor.integrations.loop import LoopMonitor

    out: dict[str, float] = {}
    quiet = io.StringIO()  # the monitors' notes (stderr) and Lightning's
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(quiet), \
            contextlib.redirect_stderr(quiet), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build()
        plain = [_plain_step(model, batch), _plain_step(model, batch)]
        writer = SummaryWriter(f"{tmp}/loop")
        t0 = CLOCK[0]()
        monitor = LoopMonitor(model, writer, max_steps=1000, probe_batch=batch)
        out["loop_ctor"] = CLOCK[0]() - t0
        t0 = CLOCK[0]()
        monitor.start(0)
        t1 = CLOCK[0]()
        model(**batch).loss.backward()
        monitor.stop()
        step0 = CLOCK[0]() - t0
        out["loop_probe"] = t1 - t0
        model.zero_grad(set_to_none=True)
        plain.append(_plain_step(model, batch))
        if monitor.off_reason or monitor.invariance_off_reason or monitor.last_result is None:
            why = monitor.off_reason or monitor.invariance_off_reason
            raise SystemExit(f"LoopMonitor measured nothing: {why}")
        out["loop_step0_extra"] = step0 - statistics.median(plain)
        monitor.detach()  # hooks off, no end-of-run sweep and summary: not a fit's start
        writer.close()
        if lightning:
            out["lightning_fit_start"] = _lightning_fit_start(build(), tmp)
    return out


def _lightning_fit_start(model, tmp: str) -> float:
    """``LayerNormMonitor``'s ``setup`` and ``on_fit_start`` on a real Trainer (not fitted)."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from lnmonitor import LayerNormMonitor

    class Module(L.LightningModule):
        def __init__(self, inner) -> None:
            super().__init__()
            self.model = inner

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    module, callback = Module(model), LayerNormMonitor()
    trainer = L.Trainer(max_steps=1000, logger=TensorBoardLogger(tmp, name="lightning"), callbacks=[callback],
                        accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    t0 = CLOCK[0]()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    seconds = CLOCK[0]() - t0
    if callback.off_reason or callback.meter is None:
        raise SystemExit(f"LayerNormMonitor did not start: {callback.off_reason}")
    callback.teardown(trainer, module, "fit")
    trainer.logger.finalize("success")  # its event file is closed before the folder goes
    return seconds


ROWS = (  # (key, label), each a time in seconds
    ("plain", "plain step (forward + backward)"),
    ("ctor", "(a) `LadderMeter(model)`"),
    ("discovery", "(a) of which discovery + float64 check"),
    ("first_extra", "(b) first measured step, extra over plain"),
    ("first_result", "(b) of which `result()`"),
    ("roles", "(b) of which role assignment"),
    ("later_extra", "(c) later measured step, extra over plain"),
    ("loop_ctor", "`LoopMonitor(model, writer, probe_batch=...)`"),
    ("loop_step0_extra", "`LoopMonitor` step 0 (probe's first run + first measured step), extra"),
    ("loop_probe", "of which the probe's first run (`start(0)`)"),
    ("lightning_fit_start", "`LayerNormMonitor` setup + on_fit_start"),
)
CHECKED = ("ctor", "roles", "first_extra", "loop_ctor", "lightning_fit_start")  # held to BUDGET_S


def summarise(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each part's median and minimum over the repeats, and its first repeat's figure."""
    keys = [k for k, _ in ROWS if all(k in r for r in runs)]
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "first": runs[0][k]} for k in keys}


QUIET = ("lightning.pytorch", "lightning.fabric")  # their notes about the Trainer, muted while timing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[80, 126],
                        help="decoder layers of each model (2 norms each, and the final one; default 80 126)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32, help="tokens a sequence (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="fresh models per size (default 5)")
    parser.add_argument("--later", type=int, default=3, help="later measured steps a repeat (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time (default), or this process's CPU time: steadier on a shared machine")
    parser.add_argument("--no-lightning", action="store_true", help="leave out LayerNormMonitor's fit start")
    parser.add_argument("--quick", action="store_true",
                        help="one model of 80 layers (161 norms), 1 repeat, 1 later step: a smoke run")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.repeats, args.later = [80], 1, 1
    if args.repeats < 1 or args.later < 1 or any(n < 1 for n in args.layers):
        parser.error("--layers, --repeats and --later must be positive")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    CLOCK[0] = CLOCKS[args.clock]
    restore = [TIMERS.wrap(meter_module, "choose_norms", "choose_norms"),
               TIMERS.wrap(LadderMeter, "_assign_roles", "_assign_roles")]
    levels = {name: logging.getLogger(name).level for name in QUIET}
    try:
        return run(args)
    finally:  # the library, torch's threads and the loggers as they were: a test calls main() in pytest's
        for undo in restore:
            undo()
        torch.set_num_threads(threads)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def run(args: argparse.Namespace) -> int:
    print(f"Llama, hidden {args.hidden}, {args.heads} heads, intermediate {args.intermediate}, vocab "
          f"{args.vocab}; batch {args.batch_size} x {args.seq} tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); {args.repeats} repeats; {args.clock} time")
    figures = {}
    for layers in args.layers:
        def build(layers=layers):
            return llama(layers, args.hidden, args.heads, args.intermediate, args.vocab)

        torch.manual_seed(1)
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq))
        batch = {"input_ids": x, "labels": x}
        runs = []
        for _ in range(args.repeats):
            one = meter_repeat(build, batch, args.later)
            one.update(monitor_repeat(build, batch, not args.no_lightning))
            runs.append(one)
        figures[layers] = {"norms": runs[0]["norms"], **summarise(runs)}
    print_table(figures)
    over = [(layers, k) for layers, f in figures.items() for k in CHECKED
            if k in f and f[k]["median"] > BUDGET_S]
    print("every part under a second" if not over else
          "over a second: " + ", ".join(f"{k} at {layers} layers" for layers, k in over))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in figures.items()}, f, indent=1)
    return 0


def print_table(figures: dict[int, dict]) -> None:
    """One column per model (median, minimum, the ratio to a plain step), and the first model's
    first repeat: the process's first fit start, which also pays its imports (matplotlib for the
    loop monitor's first picture, ...)."""
    sizes = list(figures)
    first = sizes[0]
    print("| ms | " + " | ".join(f"{layers} layers, {figures[layers]['norms']} norms: median (min)"
                                for layers in sizes)
          + f" | {first} layers, first repeat (cold process) |")
    print("|---|" + "---:|" * (len(sizes) + 1))
    for key, label in ROWS:
        cells = []
        for layers in sizes:
            f = figures[layers].get(key)
            if f is None:
                cells.append("")
                continue
            ratio = ""
            if key.endswith("extra") and key != "loop_step0_extra":
                ratio = f", {1 + f['median'] / figures[layers]['plain']['median']:.2f}x plain"
            cells.append(f"{1000 * f['median']:.1f} ({1000 * f['min']:.1f}){ratio}")
        cold = figures[first].get(key)
        cells.append("" if cold is None else f"{1000 * cold['first']:.1f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
