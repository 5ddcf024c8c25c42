"""What the benchmarks share: a TinyGPT and its batches, its training step as the recipe takes it,
variants taken in turns, the figures read from their times, and a step's peak memory.

The rule every benchmark keeps: variants run side by side in one process, interleaved so that each
is in each place of the turn equally often, and the figures are ratios (or differences) between
them, medians over turns: load from other processes hits all alike, and an absolute time on a
shared machine means little.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import TypeVar

import torch
from lightning.pytorch.callbacks import Callback

from lnmonitor.lightning import FinalNormInvarianceMonitor
from lnmonitor.tiny.model import GPTConfig, TinyGPT
from lnmonitor.tiny.recipe import Recipe

VOCAB = 65  # the corpus's characters
LN_CADENCE = 50  # the defaults measure every 50th step (the recipe's log_every_n_steps, LoopMonitor's)
PROBE_CADENCE = FinalNormInvarianceMonitor().invariance_every_n_steps  # its default: every 1000
# a new user's first runs: nanoGPT's smallest shape, the tiny model at widths 64 and 128 (width, depth, batch)
SMALL_SHAPES = [(64, 2, 12), (64, 4, 32), (128, 4, 32)]
RECIPE = Recipe()
T = TypeVar("T")


def shape(text: str) -> tuple[int, int, int]:
    """``"width,depth,batch"`` as three integers (an argparse type: nonsense is refused, saying why)."""
    try:
        width, depth, batch = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not width,depth,batch (three integers)") from None
    if min(width, depth, batch) < 1 or width % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1, the width a multiple of 4 (4 heads)")
    return width, depth, batch


def add_shapes(parser: argparse.ArgumentParser) -> None:
    """``--shapes``: width,depth,batch of each TinyGPT (context 64), by default :data:`SMALL_SHAPES`."""
    parser.add_argument("--shapes", nargs="+", type=shape, default=SMALL_SHAPES, metavar="W,D,B",
                        help="width,depth,batch of each TinyGPT (context 64; default: %(default)s)")


def set_threads(threads: int | None) -> None:
    """torch's threads (``None``: as they are)."""
    if threads:
        torch.set_num_threads(threads)


def tiny_gpt(width: int, depth: int, context: int = 64, device: str = "cpu") -> TinyGPT:
    """A TinyGPT of the corpus's vocabulary, 4 heads, from seed 0, built where it trains (a wide
    model's initialisation on the host takes minutes)."""
    torch.manual_seed(0)
    with torch.device(device):
        return TinyGPT(GPTConfig(vocab_size=VOCAB, width=width, depth=depth, heads=4, context=context))


def token_batches(count: int, batch: int, context: int, device: str = "cpu") -> torch.Tensor:
    """``count`` batches of random tokens from seed 1, ``(count, batch, context + 1)``: each
    batch's inputs are ``[:, :-1]``, its targets ``[:, 1:]``."""
    tokens = torch.randint(VOCAB, (count, batch, context + 1), generator=torch.Generator().manual_seed(1))
    return tokens.to(device)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The recipe's optimizer."""
    return torch.optim.AdamW(model.parameters(), lr=RECIPE.lr, weight_decay=RECIPE.weight_decay)


def train_step(model: TinyGPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               start: Callable[[], object] | None = None,
               stop: Callable[[torch.Tensor], object] | None = None) -> float:
    """One training step as the recipe takes it, in seconds: ``start()``, the forward and backward,
    ``stop(loss)``, gradient clipping, AdamW and clearing the gradients (on CUDA synchronised
    before and after, so the time is the device's)."""
    sync = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if start is not None:
        start()
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    if stop is not None:
        stop(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - t0


def in_turns(step: Callable[[str, int], T], modes: Sequence[str], turns: int) -> dict[str, list[T]]:
    """``step(mode, turn)`` for every mode on each of ``turns`` turns, the modes rotated turn by
    turn, then reversed and rotated again: each mode is in each place of the turn equally often
    over ``len(modes)`` turns, and each order is taken reversed as often over ``2 * len(modes)``.
    What each mode's steps returned, turn by turn."""
    out: dict[str, list[T]] = {mode: [] for mode in modes}
    for turn in range(turns):
        order = list(modes) if turn // len(modes) % 2 == 0 else list(reversed(modes))
        k = turn % len(modes)
        for mode in order[k:] + order[:k]:
            out[mode].append(step(mode, turn))
    return out


def median_extra(times: dict[str, list[float]], mode: str, keep: Sequence[int] | None = None,
                 plain: str = "plain") -> float:
    """The median, over the turns in ``keep`` (``None``: every turn), of ``mode``'s seconds less
    the plain mode's in the same turn."""
    turns = range(len(times[plain])) if keep is None else keep
    return statistics.median(times[mode][i] - times[plain][i] for i in turns)


def amortised(plain: float, idle: float = 0.0, measured: float = 0.0, probe: float = 0.0) -> float:
    """The monitors at their defaults against a plain step, each time in one unit: ``1 + (idle +
    measured / LN_CADENCE + probe / PROBE_CADENCE) / plain``, with ``idle`` an unmeasured step's
    extra, ``measured`` a measured step's extra and ``probe`` one periodic invariance run."""
    return 1 + (idle + measured / LN_CADENCE + probe / PROBE_CADENCE) / plain


def paired(times: Sequence[float], first_step: int = 0) -> float:
    """The median, over the measured (even) steps with both neighbours timed, of a measured step's
    time against the mean of its two unmeasured neighbours' (``times[i]``: step ``first_step + i``);
    steps a fraction of a second apart, far less exposed to other load than separate runs."""
    first = 1 if first_step % 2 else 2
    return statistics.median(times[i] / ((times[i - 1] + times[i + 1]) / 2)
                             for i in range(first, len(times) - 1, 2))


class StepTimer(Callback):
    """Stamps each training batch's start (after ``torch.cuda.synchronize()`` with ``sync``)."""

    def __init__(self, sync: bool = False) -> None:
        self.sync, self.starts = sync, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def gaps(self, warmup: int) -> list[float]:
        """The seconds of each step after the first ``warmup``, from its start to the next step's
        (forward, backward, optimizer, every callback and logging)."""
        return [b - a for a, b in pairwise(self.starts[warmup:])]


class PeakMemory:
    """The peak bytes allocated between entering and leaving and not freed before (``peak``): on
    CUDA ``torch.cuda.max_memory_allocated`` less what was allocated on entering; on the CPU the
    peak of ``torch.profiler``'s allocation timeline."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda, self.peak = cuda, None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                 with_stack=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
            return
        self._prof.__exit__(*exc)
        from torch.profiler._memory_profiler import Action, MemoryProfile

        live = peak = 0
        for _, action, _, size in MemoryProfile(self._prof.profiler.kineto_results).timeline:
            live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
            peak = max(peak, live)
        self.peak = peak
