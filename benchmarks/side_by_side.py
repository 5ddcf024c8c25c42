"""What the in-process benchmarks share: side by side in one process, a change and the code before it.

A TinyGPT and a meter past its role-finding step (:func:`measured_model`), one timed forward and
backward, plain or measured (:func:`timed_step`), modes stepped in turns with each mode in each
place of the turn equally often (:func:`in_turns`), their ``--shapes``/``--pairs``/``--threads``
arguments (:func:`shapes_parser`), and a module as it was at a git revision
(:func:`load_at_revision`).  Used by ``hook_split.py``, ``hooks_ab.py``, ``defer_ab.py`` and
``row_stats_ab.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lnmonitor.core.meter.meter import LadderMeter
from lnmonitor.tiny.model import GPTConfig, TinyGPT

ROOT = Path(__file__).resolve().parents[1]


def load_at_revision(rev: str, path: str, name: str, replace: tuple[str, str] | None = None):
    """The module at ``path`` as it was at ``rev``, loaded as ``name``."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    if replace:
        source = source.replace(*replace)
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measured_model(width: int, depth: int, batch: int) -> tuple[TinyGPT, torch.Tensor, LadderMeter]:
    """A TinyGPT (context 64), a batch and a meter past its role-finding step, as a fit's first
    measured step leaves them (every later measured step is like the ones timed here)."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=65, width=width, depth=depth, heads=4, context=64))
    x = torch.randint(0, 65, (batch, 65))
    meter = LadderMeter(model, say=lambda _: None, warn=lambda *_: None, watch_growth=False)
    meter.start()
    model(x[:, :-1], x[:, 1:])[1].backward()
    meter.stop()
    meter.result()
    model.zero_grad(set_to_none=True)
    return model, x, meter


def timed_step(model: TinyGPT, x: torch.Tensor, meter: LadderMeter | None,
               collect_timed: bool = False) -> tuple[float, object]:
    """One forward and backward, in seconds: plain (``meter`` None) or measured by ``meter``'s taps,
    whose rows are collected after it (inside the time with ``collect_timed``) and returned."""
    t = time.perf_counter()
    if meter is not None:
        meter.start()
    model(x[:, :-1], x[:, 1:])[1].backward()
    took = time.perf_counter() - t
    rows = None
    if meter is not None:
        meter._unhook()
        rows = meter._tap.collect()
        if collect_timed:
            took = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    return took, rows


def in_turns(step: Callable[[str], float], modes: Sequence[str],
             turns: int) -> tuple[float, dict[str, float]]:
    """``step(mode)`` for every mode, ``turns`` times, each mode in each place of the turn equally
    often: the median of ``modes[0]`` (the plain one) and each other mode's median extra time over
    the plain step of its turn."""
    orders = list(itertools.permutations(modes))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(turns):
        for mode in orders[i % len(orders)]:
            times[mode].append(step(mode))
    plain = times[modes[0]]
    extra = {m: statistics.median(a - b for a, b in zip(times[m], plain, strict=True)) for m in modes[1:]}
    return statistics.median(plain), extra


def shapes_parser(doc: str, pairs: int) -> argparse.ArgumentParser:
    """The arguments of the benchmarks that step TinyGPTs in turn: ``--shapes`` (width,depth,batch),
    ``--pairs`` (turns) and ``--threads``; call :func:`shapes_of` on what it parsed."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=[(64, 2, 12), (128, 4, 32)], type=shape,
                        help="width,depth,batch of each TinyGPT (context 64)")
    parser.add_argument("--pairs", type=int, default=pairs)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def shapes_of(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """The parsed ``--shapes``, with ``--threads`` applied to torch."""
    torch.set_num_threads(args.threads)
    return list(args.shapes)


def shape(text: str) -> tuple[int, int, int]:
    """``"width,depth,batch"`` as three integers (an argparse type: nonsense is refused, saying why)."""
    try:
        width, depth, batch = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not width,depth,batch (three integers)") from None
    if min(width, depth, batch) < 1 or width % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1, the width a multiple of 4 (4 heads)")
    return width, depth, batch
